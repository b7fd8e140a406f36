"""DPO with a LoRA adapter: the base with the adapter off as the reference, against a frozen copy of the model.

Three sides, each our own `DPO` objective built from the same saved Hugging Face directory (the `small`
preset's shape, random weights, float32, 2 threads) and stepped on the same 4 pairs of 256 tokens (a
64-token prompt): collate, `training_step` (policy and reference forwards), backward, AdamW.

- lora: r 16, lora_alpha 32, all-linear; the reference is the policy's own base, adapter switched off;
- lora+copy: the same adapter, the reference a frozen deep copy of the model (what DPO keeps without LoRA);
- full: every weight trains, the reference a frozen copy (plain DPO).

Peak memory, each side in a fresh process (peak_memory.py): the peak over a warm-up step and one more, above
what the process held before building the objective. Ratio: the other side / lora (above 1: lora needs less).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_lora_dpo_memory.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_posttrain import adamw, objective_step  # noqa: E402
from harness import Row, command_line, emit, save, setup  # noqa: E402
from peak_memory import PeakMemory, add_worker_arguments, answer_as_worker, in_fresh_process, tensor_mb  # noqa: E402

PRESET, PAIRS, SEQ_LEN, PROMPT = "small", 4, 256, 64
SIDES = ("lora", "lora+copy", "full")


def objective(side: str, folder: str):
    from astrai_pl.model import LoraConfig
    from astrai_pl.objectives import DPO
    from astrai_pl.objectives.base import frozen_copy

    lora = None if side == "full" else LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    module = DPO(init_from=folder, optimizer=adamw, lora=lora).train()
    if side == "lora+copy":
        module.__dict__["reference"] = frozen_copy(module.model)  # DPO uses a held reference when it has one
    return module


def pairs(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    batch = {}
    for side in ("chosen", "rejected"):
        ids = torch.randint(4, vocab, (PAIRS, SEQ_LEN), generator=gen)
        labels = ids.clone()
        labels[:, :PROMPT] = -100
        batch.update({f"{side}_input_ids": ids, f"{side}_labels": labels})
    return batch


def worker(side: str, folder: str) -> dict:
    import astrai_pl.objectives  # noqa: F401  (imports before the measured span)

    memory = PeakMemory()
    memory.start()
    module = objective(side, folder)
    reference = module.__dict__.get("reference")
    held = tensor_mb(module.model.parameters()) + (tensor_mb(reference.parameters()) if reference else 0.0)
    step = objective_step(module, lambda: pairs(module.model.config.vocab_size))
    step()
    step()
    return {"peak_mb": memory.rise_mb(), "weights_mb": held, "method": memory.method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows here")
    add_worker_arguments(parser, SIDES)
    args = parser.parse_args()
    setup()
    warnings.filterwarnings("ignore")
    if answer_as_worker(args, lambda side, folder: worker(side, folder)):
        return
    from astrai_pl.model import ModelConfig, Transformer

    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        Transformer(ModelConfig.from_name(PRESET)).save_pretrained(folder)
        results = {s: in_fresh_process(__file__, "--worker", s, "--folder", folder) for s in SIDES}
    command = command_line()
    ours = results["lora"]
    rows = [Row(f"DPO LoRA peak memory ({PRESET}, reference = base with adapter off)", f"DPO {peer}",
                results[peer]["peak_mb"] / ours["peak_mb"], None,
                f"peak of the steps lora {ours['peak_mb']:.0f} MB, {peer} {results[peer]['peak_mb']:.0f} MB "
                f"({ours['method']}); weights held (policy + reference) {ours['weights_mb']:.0f} MB vs "
                f"{results[peer]['weights_mb']:.0f} MB", command)
            for peer in ("lora+copy", "full")]
    emit(rows)
    save(rows, args.json)


if __name__ == "__main__":
    main()
