"""A LoRA SFT step against TRL's SFTTrainer with a PEFT LoraConfig, on the same weights and rows.

The `small` preset (~31M parameters), float32, 2 threads; LoRA r 16, lora_alpha 32, dropout 0, on every
linear projection of attention and MLP ("all-linear": 56 adapters, the lm_head not adapted) on both
sides. A step is what each trainer does per batch: collate 4 rows of 256 tokens (the first 64 of each a
prompt, not trained: 768 trained tokens), forward, loss, backward, and torch's fused AdamW over the
adapter's parameters (lr 3e-4, betas 0.9/0.95, weight decay 0.1). Ours: `SFT(lora=LoraConfig(...))`'s
`training_step` on `data.packing.collate`; TRL: `SFTTrainer(peft_config=peft.LoraConfig(...))`'s
`training_step` on its collator, with gradient checkpointing and bf16 (TRL's defaults) switched off so
both sides run the same 32-true step. Step times are interleaved in one process (harness.py).

Peak memory: each side once more in a fresh process (peak_memory.py): build the trainer from the saved
weights, then one warm-up step and `--mem-steps` steps; the peak resident set of the steps over the
resident set after imports (so weights, optimizer state and activations), with the build's own peak and
the bytes autograd saved for backward beside it. Ratio peer / ours: above 1, ours needs less.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_lora_sft.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_posttrain as posttrain  # noqa: E402
from harness import Row, command_line, duel, emit, row_from, save, setup, small_model  # noqa: E402
from peak_memory import (  # noqa: E402
    PeakMemory,
    add_worker_arguments,
    answer_as_worker,
    in_fresh_process,
    saved_for_backward_mb,
)

ROWS, SEQ_LEN, PROMPT = 4, 256, 64
RANK, ALPHA, TARGETS = 16, 32, "all-linear"


def rows() -> tuple[list[dict], list[dict]]:
    """The same 4 rows for both sides: ours with document and position ids, TRL's with labels prebuilt."""
    gen = torch.Generator().manual_seed(0)
    ids = [posttrain.random_ids(SEQ_LEN, gen) for _ in range(ROWS)]
    labels = [[-100] * PROMPT + r[PROMPT:] for r in ids]
    ours = [dict(input_ids=i, labels=lab, document_ids=[0] * SEQ_LEN, position_ids=list(range(SEQ_LEN)))
            for i, lab in zip(ids, labels)]
    return ours, [dict(input_ids=i, labels=lab) for i, lab in zip(ids, labels)]


def ours_step(folder: str):
    """Our step and the module; the loss of the first call is the model's before any update."""
    from astrai_pl.data.packing import collate
    from astrai_pl.model import LoraConfig
    from astrai_pl.objectives import SFT

    ours_rows, _ = rows()
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    module = SFT(init_from=folder, optimizer=posttrain.adamw, lora=lora).train()
    return posttrain.objective_step(module, lambda: collate(ours_rows, posttrain.PAD)), module


def trl_step(folder: str):
    """TRL's step and its trainer, on a transformers model loaded from the same folder."""
    import peft
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    _, trl_rows = rows()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    args = posttrain.trl_args(SFTConfig, tempfile.mkdtemp(), dataset_kwargs={"skip_prepare_dataset": True},
                              max_length=None, packing=False, gradient_checkpointing=False, bf16=False)
    trainer = posttrain.ready(SFTTrainer(model=hf, args=args, train_dataset=Dataset.from_list(trl_rows),
                                         processing_class=posttrain.hf_tokenizer(8192), peft_config=lora))
    if trainer.model.is_gradient_checkpointing or trainer.accelerator.mixed_precision != "no":
        raise RuntimeError("TRL's step would checkpoint activations or autocast: not the 32-true step ours runs")
    return posttrain.trainer_step(trainer, trl_rows), trainer


def trainable(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def first_losses(ours_module, trainer) -> tuple[float, float]:
    """Both models' loss on the rows before any update (B = 0: the base's), as evidence of the same work."""
    from astrai_pl.data.packing import collate

    ours_rows, trl_rows = rows()
    with torch.no_grad():
        ours = float(ours_module.training_step(collate(ours_rows, posttrain.PAD), 0))
        theirs = float(trainer.compute_loss(trainer.model, trainer.data_collator(trl_rows)))
    return ours, theirs


# -- peak memory, one fresh process per side ------------------------------------------------------------
def worker(side: str, folder: str, steps: int) -> dict:
    """Build one side from `folder`, one warm-up step and `steps` timed ones; the steps' peak memory over what
    the process held before building, and the build's own peak."""
    if side == "ours":
        import astrai_pl.data.packing  # noqa: F401  (imports before the measured span, as TRL's below)
        import astrai_pl.objectives  # noqa: F401
    else:
        import datasets  # noqa: F401
        import peft  # noqa: F401
        import transformers  # noqa: F401
        import trl  # noqa: F401
    memory = PeakMemory()
    memory.start()
    step, owner = ours_step(folder) if side == "ours" else trl_step(folder)
    build_mb = memory.rise_mb()
    memory.reset_peak()
    saved_mb = saved_for_backward_mb(step, owner.model.parameters())  # the warm-up step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_mb": memory.rise_mb(), "build_mb": build_mb, "saved_mb": saved_mb,
            "step_s": statistics.median(times), "trainable": trainable(owner.model), "method": memory.method}


def peak_rows(folder: str, steps: int, peer: str, command: str) -> Row:
    got = {side: in_fresh_process(__file__, "--worker", side, "--folder", folder, "--mem-steps", str(steps))
           for side in ("ours", "trl")}
    ours, theirs = got["ours"]["peak_mb"], got["trl"]["peak_mb"]
    o, t = got["ours"], got["trl"]
    detail = (f"peak of 1 + {steps} steps ours {ours:.0f} MB, peer {theirs:.0f} MB ({o['method']}); of it saved for "
              f"backward {o['saved_mb']:.0f} MB vs {t['saved_mb']:.0f} MB (counted); peak while building "
              f"{o['build_mb']:.0f} MB vs {t['build_mb']:.0f} MB")
    return Row(f"LoRA SFT step peak memory, r {RANK} {TARGETS}, 4 x 256", peer, theirs / ours, None, detail, command,
               1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9, help="timed steps per side, interleaved")
    parser.add_argument("--budget", type=float, default=90, help="seconds after which no new round starts "
                        "(at least 3 rounds)")
    parser.add_argument("--mem-steps", type=int, default=2, help="steps after the warm-up in each memory process")
    parser.add_argument("--json", default=None, help="also write the rows here")
    add_worker_arguments(parser, ["ours", "trl"])
    args = parser.parse_args()
    setup()
    warnings.filterwarnings("ignore")
    if answer_as_worker(args, lambda side, folder: worker(side, folder, args.mem_steps)):
        return
    command = command_line()
    try:
        import peft
        import trl
    except ImportError as err:
        rows_ = [Row("LoRA SFT step", "TRL + PEFT", None, note=f"not installable: {err}", command=command)]
        emit(rows_)
        return save(rows_, args.json)
    peer = f"TRL {trl.__version__} SFTTrainer + PEFT {peft.__version__}"
    with tempfile.TemporaryDirectory() as folder:
        small_model().save_pretrained(folder)
        (ours, module), (theirs, trainer) = ours_step(folder), trl_step(folder)
        loss_ours, loss_trl = first_losses(module, trainer)
        counts = trainable(module.model), trainable(trainer.model)
        if counts[0] != counts[1]:
            raise RuntimeError(f"trainable parameters differ: ours {counts[0]}, TRL+PEFT {counts[1]}")
        result = duel(ours, theirs, args.reps, warmup=2, budget_s=args.budget)
        timing = row_from(result, f"LoRA SFT step, r {RANK} {TARGETS}, 32-true, 4 x 256", peer, 1, "s/step",
                          command, 1.3)
        timing.detail += (f"; {counts[0]:,} trainable parameters each; loss before any update ours {loss_ours:.5f}, "
                          f"peer {loss_trl:.5f}")
        emit([timing])
        del ours, theirs, module, trainer
        memory = peak_rows(folder, args.mem_steps, peer, command)
        emit([memory])
    save([timing, memory], args.json)


if __name__ == "__main__":
    main()
