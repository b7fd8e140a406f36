"""What adapters save on a ~135M-parameter model: LoRA against our full fine-tune, QLoRA against LoRA.

The SmolLM2-135M preset's shape (30 layers, hidden 576, vocab 49152, tied embeddings; random weights, saved
as a Hugging Face directory and read back by each objective's `init_from`), float32, 2 threads. Every
side is our own `SFT` objective on the same 4 rows of 256 tokens (the first 64 a prompt): a step is
collate, `training_step`, backward and fused AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1) over what
trains:

- full: every weight, AdamW state for all of them;
- LoRA: r 16, lora_alpha 32, all-linear (every projection of attention and MLP), the base frozen;
- QLoRA: the same adapters over a base whose linear weights are stored in NF4 (`quantize="nf4"`),
  dequantised per matmul. Left out, with a note, where the objective has no `quantize` option yet.

Peak memory: each side in a fresh process (peak_memory.py): the peak over one warm-up step and
`--mem-steps` steps, above what the process held before building the objective out of the saved directory
(weights, gradients, optimizer state, activations); the build's own peak, and the bytes autograd saved for
backward in the warm-up step, beside it. Step times: the sides interleaved in one
process (harness.py). Ratios as everywhere in benchmarks/: the other side / the side named in the measure
(above 1: the named side needs less memory or time).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_lora_memory.py
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_posttrain import PAD, adamw, objective_step  # noqa: E402
from harness import Duel, Row, command_line, duels, emit, save, setup  # noqa: E402
from peak_memory import (  # noqa: E402
    PeakMemory,
    add_worker_arguments,
    answer_as_worker,
    in_fresh_process,
    saved_for_backward_mb,
    tensor_mb,
)

PRESET, ROWS, SEQ_LEN, PROMPT = "SmolLM2-135M", 4, 256, 64
SIDES = ("lora", "full", "qlora")


def qlora_available() -> bool:
    from astrai_pl.objectives.base import Objective

    return "quantize" in inspect.signature(Objective.__init__).parameters


def objective(side: str, folder: str):
    """Our SFT objective for one side, built from the saved directory."""
    from astrai_pl.model import LoraConfig
    from astrai_pl.objectives import SFT

    options = {}
    if side != "full":
        options["lora"] = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    if side == "qlora":
        options["quantize"] = "nf4"
    return SFT(init_from=folder, optimizer=adamw, **options).train()


def step_of(module):
    """One optimizer step of `module` on the benchmark's rows."""
    from astrai_pl.data.packing import collate

    gen = torch.Generator().manual_seed(0)
    vocab = module.model.config.vocab_size
    ids = [torch.randint(4, vocab, (SEQ_LEN,), generator=gen).tolist() for _ in range(ROWS)]
    rows = [dict(input_ids=i, labels=[-100] * PROMPT + i[PROMPT:], document_ids=[0] * SEQ_LEN,
                 position_ids=list(range(SEQ_LEN))) for i in ids]
    return objective_step(module, lambda: collate(rows, PAD))


def worker(side: str, folder: str, steps: int) -> dict:
    """Build one side, one warm-up step and `steps` more. The peak of the steps, over what the process held
    before building (so weights, optimizer state and activations), and the build's own peak beside it."""
    import astrai_pl.data.packing  # noqa: F401  (imports before the measured span)
    import astrai_pl.objectives  # noqa: F401

    memory = PeakMemory()
    memory.start()
    start = time.perf_counter()
    module = objective(side, folder)
    build_s, build_mb = time.perf_counter() - start, memory.rise_mb()
    memory.reset_peak()
    step = step_of(module)
    saved_mb = saved_for_backward_mb(step, module.model.parameters())  # the warm-up step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    held_mb = tensor_mb(module.model.parameters()) + 3 * 4 * trainable / 2**20  # + float32 gradient, AdamW m and v
    return {"peak_mb": memory.rise_mb(), "held_mb": held_mb, "build_mb": build_mb, "saved_mb": saved_mb, "build_s": build_s,
            "step_s": statistics.median(times), "trainable": trainable, "method": memory.method}


def save_random_model(folder: str) -> int:
    from astrai_pl.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(PRESET))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def memory_row(measure: str, peer: str, named: dict, other: dict, command: str) -> Row:
    name = measure.split(" ")[0]
    detail = (f"peak of the steps {name} {named['peak_mb']:.0f} MB, {peer} {other['peak_mb']:.0f} MB "
              f"({named['method']}); weights + gradients + AdamW state {named['held_mb']:.0f} MB vs "
              f"{other['held_mb']:.0f} MB and saved for backward {named['saved_mb']:.0f} MB vs "
              f"{other['saved_mb']:.0f} MB (counted); peak while building the objective from the directory "
              f"{named['build_mb']:.0f} MB vs {other['build_mb']:.0f} MB ({named['build_s']:.0f} s vs "
              f"{other['build_s']:.0f} s); trainable parameters {named['trainable']:,} vs {other['trainable']:,}")
    return Row(measure, peer, other["peak_mb"] / named["peak_mb"], None, detail, command)


def time_row(measure: str, peer: str, result: Duel, command: str) -> Row:
    detail = (f"median {measure.split(' ')[0]} {result.median('ours'):.2f} s/step, {peer} "
              f"{result.median('peer'):.2f} s/step; {result.spread()}")
    return Row(measure, peer, result.ratio("wall"), result.ratio("cpu"), detail, command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed steps per side, interleaved")
    parser.add_argument("--budget", type=float, default=120, help="seconds after which no new round starts "
                        "(at least 3 rounds)")
    parser.add_argument("--mem-steps", type=int, default=1, help="steps after the warm-up in each memory process")
    parser.add_argument("--memory-only", action="store_true", help="leave the step-time duels out")
    parser.add_argument("--json", default=None, help="also write the rows here")
    add_worker_arguments(parser, SIDES)
    args = parser.parse_args()
    setup()
    warnings.filterwarnings("ignore")
    if answer_as_worker(args, lambda side, folder: worker(side, folder, args.mem_steps)):
        return
    command, shape = command_line(), f"{PRESET} shape, 4 x 256"
    sides = SIDES if qlora_available() else SIDES[:2]
    with tempfile.TemporaryDirectory() as folder:
        params = save_random_model(folder)
        print(f"{PRESET} shape: {params / 1e6:.1f}M parameters", flush=True)
        peaks = {side: in_fresh_process(__file__, "--worker", side, "--folder", folder, "--mem-steps",
                                        str(args.mem_steps)) for side in sides}
        if not args.memory_only:
            steps = {side: step_of(objective(side, folder)) for side in sides}
            result = duels(steps, args.reps, warmup=1, budget_s=args.budget)
    out = [memory_row(f"LoRA SFT step peak memory, {shape}", "full fine-tune", peaks["lora"], peaks["full"], command)]
    if not args.memory_only:
        out.append(time_row(f"LoRA SFT step time, {shape}", "full fine-tune", result["full"], command))
    if "qlora" in sides:
        out.append(memory_row(f"QLoRA SFT step peak memory, {shape}", "LoRA", peaks["qlora"], peaks["lora"], command))
    if "qlora" in sides and not args.memory_only:
        flipped = Duel(result["qlora"].peer, result["qlora"].ours)  # QLoRA named, LoRA the other side
        out.append(time_row(f"QLoRA SFT step time, {shape}", "LoRA", flipped, command))
    if "qlora" not in sides:
        out.append(Row(f"QLoRA SFT step, {shape}", "LoRA", None, command=command,
                       note="not measured: the objectives have no quantize option yet"))
    emit(out)
    save(out, args.json)


if __name__ == "__main__":
    main()
