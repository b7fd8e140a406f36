"""Training throughput on one GPU: ours against transformers' LlamaForCausalLM, eager and torch.compile'd.

    python benchmarks/gpu_train.py [--steps 14] [--batch 8] [--seq 2048] [--only NAME …] [--json FILE]
    python benchmarks/gpu_train.py --dry-run      # every run below on CPU, on a tiny shape, in seconds

The shape is the `Llama-3.2-1B` preset (random weights, random tokens), bf16 autocast over float32 weights,
fused AdamW, gradient clipping at 1.0. Each run takes `--steps` optimizer steps; the step time is the
median of the second half (plain loops), or the second half's wall time over its steps (Trainer.fit, one
synchronisation at the end). It prints s/step, tokens/s, MFU against 989 TFLOP/s (bf16 dense, H100/H200),
peak memory, and each run's tokens/s as a ratio to transformers + torch.compile.

    hf-eager / hf-compiled   LlamaForCausalLM (SDPA), eager and torch.compile(model)
    ours-plain               Transformer.hidden_states + linear_cross_entropy in a plain loop
    ours-plain-liger         the same with Liger-Kernel's fused loss (when the `gpu` extra is installed)
    ours-fit / ours-fit-compile   Pretrain through Trainer.fit, compile False / True (the whole model)
    packed-sdpa / packed-flex / packed-varlen   packed SFT rows (document_ids) on each attention kernel
    fp8-tensorwise / fp8-rowwise   ours-plain with float8 linears (torchao), where the FP8 entry exists
    qlora                    NF4 base, LoRA r 16 on all linears
    fsdp2                    Pretrain(compile=True) on 2 GPUs with FSDP2 (only where 2 GPUs exist)

The dry run uses the `debug` preset, 2 × 64 tokens, 2 steps, compile through dynamo's eager backend
(inductor's C++ build would take minutes on CPU), and prints the same table with meaningless figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from harness import Row, save  # noqa: E402

from astrai_pl import parallel  # noqa: E402
from astrai_pl.model import LoraConfig, ModelConfig, Transformer, packed_attention  # noqa: E402
from astrai_pl.model.flops import training_flops  # noqa: E402
from astrai_pl.model.lora import apply_lora  # noqa: E402
from astrai_pl.model.nf4 import quantize_base  # noqa: E402
from astrai_pl.objectives.losses import linear_cross_entropy, next_token_labels  # noqa: E402
from astrai_pl.ops import lm_head_loss  # noqa: E402

PEAK_FLOPS = 989e12  # bf16 dense, H100 / H200 SXM
PEER = "hf-compiled"
TARGETS = {"ours-fit-compile": 1.2}  # tokens/s over transformers + torch.compile (packed and FP8: see docs)


@dataclass
class Result:
    run: str
    seconds: float | None = None  # per step
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gb: float | None = None
    note: str = ""


@dataclass
class Setup:
    preset: str
    arch: ModelConfig
    batch: int
    seq: int
    steps: int
    device: torch.device
    dry: bool

    def tokens(self, packed: bool = False) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.arch.vocab_size, (self.batch, self.seq), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if packed:  # documents of 64..seq/2 tokens, as SFT packing lays them out
            lengths = torch.randint(max(self.seq // 32, 4), max(self.seq // 2, 8), (self.batch, self.seq), generator=g)
            starts = torch.zeros(self.batch, self.seq, dtype=torch.bool)
            for row in range(self.batch):
                at = 0
                for n in lengths[row].tolist():
                    if at >= self.seq:
                        break
                    starts[row, at] = True
                    at += n
            batch["document_ids"] = starts.long().cumsum(1)
        return {k: v.to(self.device) for k, v in batch.items()}

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def optimizer_for(params) -> torch.optim.Optimizer:
    trainable = [p for p in params if p.requires_grad]
    fused = bool(trainable) and trainable[0].is_cuda
    return torch.optim.AdamW(trainable, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_loop(setup: Setup, step, name: str, tokens: int, pairs: float) -> Result:
    """Run `step()` setup.steps times; the median of the second half."""
    times = []
    for _ in range(setup.steps):
        start = time.perf_counter()
        step()
        sync(setup.device)
        times.append(time.perf_counter() - start)
    return result(setup, name, statistics.median(times[len(times) // 2:]), tokens, pairs)


def result(setup: Setup, name: str, seconds: float, tokens: int, pairs: float, note: str = "") -> Result:
    flops = training_flops(setup.arch, tokens, pairs)
    peak = torch.cuda.max_memory_allocated(setup.device) / 1e9 if setup.device.type == "cuda" else None
    return Result(name, seconds, tokens / seconds, flops / seconds / PEAK_FLOPS, peak, note)


def causal_pairs(batch: dict[str, torch.Tensor]) -> float:
    """(query, key) pairs attention scores: causal within each document."""
    ids = batch.get("document_ids")
    if ids is None:
        B, T = batch["input_ids"].shape
        return B * T * (T + 1) / 2
    lengths = [torch.unique_consecutive(row, return_counts=True)[1].double() for row in ids.cpu()]
    return float(sum((n * (n + 1) / 2).sum() for n in lengths))


def maybe_compile(module, setup: Setup):
    return torch.compile(module, backend="eager") if setup.dry else torch.compile(module)


# -- the runs -----------------------------------------------------------------------------------------------
def run_hf(setup: Setup, compiled: bool) -> Result:
    import transformers

    a = setup.arch
    config = transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, max_position_embeddings=a.max_position_embeddings,
        rms_norm_eps=a.rms_norm_eps, tie_word_embeddings=a.tie_word_embeddings, attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(setup.device).train()
    forward = maybe_compile(model, setup) if compiled else model
    opt, batch = optimizer_for(model.parameters()), setup.tokens()

    def step():
        with setup.autocast():
            loss = forward(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    name = "hf-compiled" if compiled else "hf-eager"
    return timed_loop(setup, step, name, batch["input_ids"].numel(), causal_pairs(batch))


def plain_step(setup: Setup, model: Transformer, batch: dict[str, torch.Tensor], hidden_fn=None):
    """One optimizer step of ours without Lightning: hidden states, the fused lm_head loss, AdamW, clip."""
    opt, hidden_fn = optimizer_for(model.parameters()), hidden_fn or model.hidden_states
    params = [p for p in model.parameters() if p.requires_grad]
    targets = next_token_labels(batch["labels"])

    def step():
        with setup.autocast():
            hidden, _ = hidden_fn(batch["input_ids"], None, batch.get("document_ids"))
            loss = linear_cross_entropy(hidden, model.lm_head.weight, targets)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run_plain(setup: Setup, name: str, packed: bool = False, prepare=None) -> Result:
    model = Transformer(setup.arch).to(setup.device).train()
    if prepare is not None:
        prepare(model)
    batch = setup.tokens(packed)
    return timed_loop(setup, plain_step(setup, model, batch), name, batch["input_ids"].numel(), causal_pairs(batch))


def run_liger(setup: Setup) -> Result:
    if not lm_head_loss.liger_runs_on(setup.device) and not setup.dry:
        return Result("ours-plain-liger", note="skipped: Liger-Kernel needs CUDA and the `gpu` extra")
    lm_head_loss.override_lm_head_loss("liger")  # on CPU: the one-line fallback to ours
    try:
        return run_plain(setup, "ours-plain-liger")
    finally:
        lm_head_loss.override_lm_head_loss(None)


def run_packed(setup: Setup, backend: str) -> Result:
    if backend == "varlen" and not packed_attention.flash_varlen_available() and not setup.dry:
        return Result("packed-varlen", note="skipped: flash-attn is not installed")
    packed_attention.override_packed_attention(backend)
    try:
        return run_plain(setup, f"packed-{backend}", packed=True)
    finally:
        packed_attention.override_packed_attention(None)


def run_fp8(setup: Setup, recipe: str) -> Result:
    convert = getattr(parallel, "convert_to_fp8", None)
    if convert is None:
        return Result(f"fp8-{recipe}", note="skipped: this build has no astrai_pl.parallel.convert_to_fp8")
    model = Transformer(setup.arch).to(setup.device).train()
    try:
        convert(model, recipe)
    except Exception as err:  # refused on a device without FP8: the reason is the result
        return Result(f"fp8-{recipe}", note=f"refused: {str(err).splitlines()[0][:120]}")
    batch = setup.tokens()
    return timed_loop(setup, plain_step(setup, model, batch), f"fp8-{recipe}", batch["input_ids"].numel(),
                      causal_pairs(batch))


def run_qlora(setup: Setup) -> Result:
    def prepare(model):
        quantize_base(model)
        apply_lora(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"))

    return run_plain(setup, "qlora", prepare=prepare)


class StepClock:
    """A Lightning callback: the time at each step's start, one synchronisation when training ends."""

    def __init__(self, device: torch.device):
        self.device, self.starts, self.end = device, [], None

    def on_train_batch_start(self, *args) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args) -> None:
        sync(self.device)
        self.end = time.perf_counter()

    def seconds(self) -> float:
        half = len(self.starts) // 2
        return (self.end - self.starts[half]) / (len(self.starts) - half)


def fit_module(setup: Setup, compile: bool):
    from astrai_pl.objectives import Pretrain

    def optimizer(groups):
        return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=setup.device.type == "cuda")

    return Pretrain(arch=setup.arch, optimizer=optimizer, compile=compile)


def trainer_for(setup: Setup, clock, **options):
    import lightning as L

    callback = type("Clock", (L.Callback,), {name: getattr(clock, name) for name in
                                             ("on_train_batch_start", "on_train_end")})()
    return L.Trainer(accelerator="gpu" if setup.device.type == "cuda" else "cpu", precision="bf16-mixed",
                     max_steps=setup.steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **options)


def run_fit(setup: Setup, compile: bool) -> Result:
    from torch.utils.data import DataLoader

    batch = {k: v.cpu() for k, v in setup.tokens().items()}
    clock = StepClock(setup.device)
    trainer = trainer_for(setup, clock, devices=1)
    trainer.fit(fit_module(setup, compile), DataLoader([batch] * setup.steps, batch_size=None))
    name = "ours-fit-compile" if compile else "ours-fit"
    return result(setup, name, clock.seconds(), batch["input_ids"].numel(), causal_pairs(batch))


def run_fsdp2(setup: Setup, out: Path | None) -> Result:
    """Pretrain(compile=True) on two GPUs with FSDP2; Lightning relaunches this script (`--only fsdp2`) per rank."""
    from torch.utils.data import DataLoader

    from astrai_pl.strategy import FSDP2Strategy

    batch = {k: v.cpu() for k, v in setup.tokens().items()}
    clock = StepClock(setup.device)
    trainer = trainer_for(setup, clock, devices=2, strategy=FSDP2Strategy())
    trainer.fit(fit_module(setup, not setup.dry), DataLoader([batch] * setup.steps, batch_size=None))
    tokens = 2 * batch["input_ids"].numel()  # both ranks' rows per step
    done = result(setup, "fsdp2", clock.seconds(), tokens, 2 * causal_pairs(batch), note="2 GPUs, tokens of both")
    done.mfu = done.mfu / 2 if done.mfu is not None else None  # against two GPUs' peak
    if trainer.global_rank == 0 and out is not None:
        out.write_text(json.dumps([asdict(done)]))
    return done


def fsdp2_in_a_process(args) -> Result:
    if torch.cuda.device_count() < 2:
        return Result("fsdp2", note=f"skipped: {torch.cuda.device_count()} GPU(s), needs 2")
    out = Path(args.scratch) / "fsdp2.json"
    cmd = [sys.executable, __file__, "--only", "fsdp2", "--steps", str(args.steps), "--batch", str(args.batch),
           "--seq", str(args.seq), "--results", str(out)]
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode or not out.exists():
        return Result("fsdp2", note=f"failed (exit {done.returncode}); run {' '.join(cmd[1:])} alone")
    return Result(**json.loads(out.read_text())[0])


RUNS = {
    "hf-eager": lambda s: run_hf(s, compiled=False),
    "hf-compiled": lambda s: run_hf(s, compiled=True),
    "ours-plain": lambda s: run_plain(s, "ours-plain"),
    "ours-plain-liger": run_liger,
    "ours-fit": lambda s: run_fit(s, compile=False),
    "ours-fit-compile": lambda s: run_fit(s, compile=True),
    "packed-sdpa": lambda s: run_packed(s, "sdpa"),
    "packed-flex": lambda s: run_packed(s, "flex"),
    "packed-varlen": lambda s: run_packed(s, "varlen"),
    "fp8-tensorwise": lambda s: run_fp8(s, "tensorwise"),
    "fp8-rowwise": lambda s: run_fp8(s, "rowwise"),
    "qlora": run_qlora,
}


def table(results: list[Result]) -> str:
    peer = next((r.tokens_per_s for r in results if r.run == PEER and r.tokens_per_s), None)
    lines = ["| run | s/step | tokens/s | MFU | peak GB | vs hf-compiled | note |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.seconds is None:
            lines.append(f"| {r.run} | - | - | - | - | - | {r.note} |")
            continue
        peak = "-" if r.peak_gb is None else f"{r.peak_gb:.1f}"
        ratio = "-" if peer is None else f"{r.tokens_per_s / peer:.2f}x"
        lines.append(f"| {r.run} | {r.seconds:.3f} | {r.tokens_per_s / 1e3:.1f}k | {100 * r.mfu:.1f} % | {peak} | "
                     f"{ratio} | {r.note} |")
    return "\n".join(lines)


def rows_for_run_all(results: list[Result]) -> list[Row]:
    """The results as `make bench` rows: tokens/s over transformers + torch.compile's in the same run."""
    peer = next((r.tokens_per_s for r in results if r.run == PEER and r.tokens_per_s), None)
    rows = []
    for r in results:
        if r.run == PEER:
            continue
        detail = "" if r.seconds is None else (f"{r.seconds:.3f} s/step, {r.tokens_per_s / 1e3:.1f}k tokens/s, "
                                               f"MFU {100 * r.mfu:.1f} %, peak {r.peak_gb or 0:.1f} GB")
        ratio = None if peer is None or r.tokens_per_s is None else r.tokens_per_s / peer
        rows.append(Row(f"GPU training: {r.run} tokens/s", "transformers + torch.compile", ratio, None, detail,
                        "python benchmarks/gpu_train.py", TARGETS.get(r.run), r.note))
    return rows


def measure(name: str, setup: Setup) -> Result:
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(setup.device)
    torch.manual_seed(0)
    print(f"== {name}", flush=True)
    return RUNS[name](setup)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--only", nargs="+", choices=[*RUNS, "fsdp2"], default=[*RUNS, "fsdp2"])
    parser.add_argument("--dry-run", action="store_true", help="every run on CPU, tiny shape, 2 steps")
    parser.add_argument("--json", help="also write `make bench` rows here (benchmarks/run_all.py)")
    parser.add_argument("--results", type=Path, help="also write the raw results here")
    parser.add_argument("--scratch", default="/tmp", help="where the FSDP2 run leaves its result")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry_run:
        torch.compile = functools.partial(torch.compile, backend="eager")  # dynamo's trace, no inductor build
        setup = Setup("debug", ModelConfig.from_name("debug"), 2, 64, 2, torch.device("cpu"), dry=True)
    elif not torch.cuda.is_available():
        print("benchmarks/gpu_train.py needs a CUDA device (or --dry-run)")
        return 2
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        setup = Setup("Llama-3.2-1B", ModelConfig.from_name("Llama-3.2-1B"), args.batch, args.seq, args.steps,
                      torch.device("cuda"), dry=False)
    if args.only == ["fsdp2"] and (args.dry_run or torch.cuda.device_count() >= 2):
        results = [run_fsdp2(setup, args.results) if not args.dry_run else Result("fsdp2", note="skipped in a dry run")]
    else:
        results = [measure(n, setup) for n in args.only if n != "fsdp2"]
        if "fsdp2" in args.only:
            results.append(fsdp2_in_a_process(args) if not args.dry_run else
                           Result("fsdp2", note="skipped in a dry run (2 processes)"))
    where = torch.cuda.get_device_name() if setup.device.type == "cuda" else "CPU (dry run)"
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    print(f"\n{where}, torch {torch.__version__}{cuda}, {setup.preset}, batch {setup.batch} x {setup.seq}, "
          f"{setup.steps} steps\n")
    print(table(results))
    if args.only != ["fsdp2"]:
        save(rows_for_run_all(results), args.json)
        if args.results is not None:
            args.results.write_text(json.dumps([asdict(r) for r in results]))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
