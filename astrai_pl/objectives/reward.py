"""Reward modelling: a scalar score per sequence, trained on preference pairs with the Bradley–Terry loss.

The model is the shared Transformer with its lm_head replaced by a score head, a (1, hidden) linear layer — what
`transformers`' *ForSequenceClassification models with num_labels=1 call `score`. The score of a sequence is the
head applied to the final hidden state of its last token, as the Hugging Face classes pool it (they take the last
token that is not padding). The head sits where the lm_head sat, so sharding, tensor parallel, checkpoints and the
optimizer treat it as part of the model; a LoRA run trains it in full beside the adapter and keeps it in its
checkpoints.

`RewardModel.save_pretrained(dir)` writes a Hugging Face sequence-classification directory (e.g.
LlamaForSequenceClassification) that `AutoModelForSequenceClassification` loads and that scores as this model
does. The callbacks that generate or export a causal language model (HFExport, SampleGenerations, ModelArtifact)
are refused before step 1.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..atomic import remove_path, replace_path
from ..checkpoint import CheckpointError, read_checkpoint
from ..model import Transformer
from ..model.config import ConfigError
from ..model.export_manifest import MANIFEST, ExportConflictError, write_manifest, written_by_export
from ..model.hf_config import ARCHITECTURES, ExportError
from ..model.lora import merge_lora
from .options import check_reward_options
from .orpo import PairObjective
from .preference_losses import bradley_terry_loss
from .shared_prompt import last_scored_positions, pair_hidden_states

SCORE_KEY = "score.weight"
CAUSAL_CALLBACKS = ("HFExport", "SampleGenerations", "ModelArtifact")  # need an lm_head


def score_head(model: Transformer) -> nn.Linear:
    """A fresh (1, hidden) score layer, initialised as transformers initialises `score` (normal, initializer_range)."""
    head = nn.Linear(model.config.hidden_size, 1, bias=False)
    nn.init.normal_(head.weight, 0.0, model.config.initializer_range)
    return head.to(device=model.embed_tokens.weight.device, dtype=model.embed_tokens.weight.dtype)


def sequence_scores(model: Transformer, input_ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The score head on the final hidden state at position `last` (B,) of each sequence.  (B,)"""
    hidden, _ = model.hidden_states(input_ids, output_rows=last[:, None])  # (B, 1, H)
    return model.lm_head(hidden[:, 0]).squeeze(-1).float()


class RewardModel(PairObjective):
    """L = −mean over pairs of log σ(s_c − s_r) [+ c · mean (s_c + s_r)²]  (see `bradley_terry_loss`).

    s: the score of the chosen (c) and the rejected (r) sequence (prompt and response), read at its last token. Both
    sides of every pair go through the model in one forward, the prompt they share computed once (`shared_prompt`);
    the per-pair mean is exact under gradient accumulation (DPOData tags batches with `window_pairs`). Metrics, with
    TRL's names, under train/ and val/: accuracy, margin, mean_reward, min_reward, max_reward.
    """

    def __init__(self, *args: Any, center_rewards_coefficient: float | None = None, **kwargs: Any):
        """
        Args:
            center_rewards_coefficient: c, the weight of mean (s_c + s_r)², which keeps the scores centred on 0
                (Eisenstein et al., 2023, use 0.01); null = none (TRL's default).
        """
        check_reward_options(center_rewards_coefficient)
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.center_rewards_coefficient = center_rewards_coefficient
        self.model.lm_head = score_head(self.model)  # in place of the (vocab, hidden) output layer

    def setup(self, stage: str) -> None:
        super().setup(stage)
        causal = sorted({type(cb).__name__ for cb in self.trainer.callbacks} & set(CAUSAL_CALLBACKS))
        if causal:
            raise ConfigError(f"trainer.callbacks {causal}: they generate with or export a causal language model, and a "
                              "RewardModel has a score head instead of one; remove them (wandb.samples_every_n_steps: "
                              "0, wandb.log_model: false) and export with RewardModel.save_pretrained")

    def _adapter_keys(self) -> set[str]:
        return super()._adapter_keys() | {"model.lm_head.weight"}  # a LoRA run trains the head in full

    def scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores of the chosen and the rejected sequences of a DPOData batch.  (B,), (B,)"""
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])  # (2B, T)
        # (2B, H) at each sequence's last token, each shared prompt computed once if that pays
        hidden = pair_hidden_states(self.model, batch, at=last_scored_positions(labels))
        return self.model.lm_head(hidden).squeeze(-1).float().chunk(2)

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        chosen, rejected = self.scores(batch)
        loss, metrics = bradley_terry_loss(chosen, rejected, batch.get("margin"),  # (B,): rows with a `margin`
                                           center_rewards_coefficient=self.center_rewards_coefficient)
        return self._per_pair(loss, batch), metrics

    # -- export -------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path: str | Path) -> RewardModel:
        """The reward model a checkpoint of `astrai-pl fit` holds (a LoRA run's over the base in its init_from),
        in eval mode, without a trainer: what `save_pretrained` exports from."""
        ckpt = read_checkpoint(path)
        hp = ckpt.get("hyper_parameters") or {}
        if "arch" not in hp:
            raise CheckpointError(f"{path}: no model shape in its hyper_parameters; pass a checkpoint written by "
                                  "astrai-pl fit with model.class_path astrai_pl.objectives.RewardModel")
        adapter_only = "lora_base" in ckpt
        module = cls(arch=hp["arch"], init_from=hp.get("init_from") if adapter_only else None, lora=hp.get("lora"),
                     center_rewards_coefficient=hp.get("center_rewards_coefficient"))
        module.load_state_dict(ckpt["state_dict"], strict=not adapter_only)
        return module.eval()

    def save_pretrained(self, path: str | Path, tokenizer: Any = None, overwrite: bool = False) -> None:
        """Write a Hugging Face sequence-classification directory (num_labels=1, the head as `score.weight`) and,
        if given (default: the objective's), the tokenizer's files; a LoRA adapter is merged into the copy
        written. Call on an unsharded model (e.g. one loaded from a checkpoint). A folder holding files no export
        wrote is refused unless `overwrite` (which replaces the folder whole)."""
        save_reward_model(self.model, path, tokenizer if tokenizer is not None else self.tokenizer, overwrite)


def _sequence_classifier(model_type: str) -> str:
    causal = ARCHITECTURES.get(model_type, "")
    if not causal.endswith("ForCausalLM") or model_type == "rwkv":
        raise ExportError(f"model_type={model_type!r} has no sequence-classification class in transformers to export "
                          "a reward model as; train the reward model on a llama, mistral or qwen architecture")
    return causal.removesuffix("ForCausalLM") + "ForSequenceClassification"


def save_reward_model(model: Transformer, path: str | Path, tokenizer: Any = None, overwrite: bool = False) -> None:
    """`model` (its lm_head a (1, hidden) score head) as a Hugging Face sequence-classification directory.

    The causal export (`save_pretrained`) is written beside the target first, its output layer renamed `score`
    and its config.json made a classifier's; then it replaces the target in one move (atomic.replace_path), so
    the target is never half written. The whole folder is replaced, so a target holding files no export wrote
    is refused (ExportConflictError) before anything is written, unless `overwrite`.
    """
    target = Path(path)
    _check_replaceable(target, overwrite)
    cfg = dataclasses.replace(model.config, tie_word_embeddings=False)  # the head never shares the embedding
    architecture = _sequence_classifier(cfg.model_type)
    plain = copy.deepcopy(model)
    if plain.lora_config is not None:
        merge_lora(plain)
    plain.config = cfg
    staging = target.with_name(f".{target.name}.causal")
    remove_path(staging)
    plain.save_pretrained(staging, tokenizer=tokenizer)
    for file in sorted(staging.glob("model*.safetensors")):
        tensors = load_file(file)
        if "lm_head.weight" in tensors:
            tensors[SCORE_KEY] = tensors.pop("lm_head.weight")
            save_file(tensors, str(file), metadata={"format": "pt"})
    index = staging / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"][SCORE_KEY] = data["weight_map"].pop("lm_head.weight")
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    config = json.loads((staging / "config.json").read_text())
    pad = getattr(tokenizer, "pad_token_id", None)
    config.update(architectures=[architecture], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
                  pad_token_id=pad if pad is not None else config.get("pad_token_id"))
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_manifest(staging, [entry.name for entry in staging.iterdir() if entry.is_file()])  # as renamed above
    replace_path(staging, target)


def _check_replaceable(target: Path, overwrite: bool) -> None:
    if overwrite or not target.is_dir():
        return
    foreign = sorted({entry.name for entry in target.iterdir()} - written_by_export(target) - {MANIFEST})
    if foreign:
        raise ExportConflictError(
            f"{target}: holds {', '.join(foreign[:5])}{' and more' if len(foreign) > 5 else ''}, which no export "
            "wrote, and a reward model replaces its folder whole; nothing was written. Fix: save into an empty or "
            "new folder, or pass overwrite=True to replace the folder and everything in it.")
