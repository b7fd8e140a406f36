"""Helpers for tests that run LoRA fits in subprocesses: a base model written as a Hugging Face directory, the
debug config turned into a LoRA run from it, and a probe that writes every rank's gathered weights. Imported by
test_lora_parallel.py and test_lora_resume.py (and, by class path, by the runs they launch)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import yaml
from fit_runs import debug_config

from astrai_pl.model import ModelConfig, Transformer

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def save_base(folder: Path, seed: int = 0) -> Path:
    """A debug-preset Transformer with random weights, written as a Hugging Face directory."""
    torch.manual_seed(seed)
    Transformer(ModelConfig.from_name("debug")).save_pretrained(folder)
    return folder


def lora_debug_config(folder: Path, corpus: Path, base: Path, **kwargs) -> Path:
    """fit_runs.debug_config as a LoRA run (LORA) from the Hugging Face directory `base`: its checkpoints hold the
    adapter only, and its HF exports are PEFT adapter directories."""
    path = debug_config(folder, corpus, **kwargs)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["init_args"].update(init_from=str(base), lora=dict(LORA))
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def gathered_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of `model`, whole on every rank (FSDP2 shards gathered), on CPU."""
    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in state.items()}


class RankWeights(L.Callback):
    """Test probe: when training ends every rank writes the weights it holds, gathered, to
    weights-rank{R}.safetensors (collective under FSDP2: every rank takes part)."""

    def on_train_end(self, trainer, pl_module):
        from safetensors.torch import save_file

        state = gathered_weights(pl_module.model)
        save_file({k: v.contiguous() for k, v in state.items()}, f"weights-rank{trainer.global_rank}.safetensors")


def rank_weights(folder: Path, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / f"weights-rank{rank}.safetensors"))


def base_weights(base: Path) -> dict[str, torch.Tensor]:
    return Transformer.from_pretrained(base).state_dict()
