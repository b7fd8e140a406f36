"""Training-step costs of the layouts in astrai_pl/parallel.py, each against its peer in the same run:

1. activation checkpointing none / full / selective: peak memory and step time (peer: none);
2. precision 32-true vs bf16-mixed (autocast; on CPUs with AMX the bf16 matmuls run on matrix units);
3. FSDP2 over 2 processes (gloo / nccl) vs one process on the same global batch; on CPU the two
   processes split OMP_NUM_THREADS between them (at least one thread each).

A step is forward, cross-entropy, backward and AdamW on a fresh preset model, without Lightning. Every
configuration runs in a fresh process, so peak memory is its own: CUDA's peak allocation, or on CPU the
rise of the process's peak RSS during the steps.

    OMP_NUM_THREADS=2 taskset -c 0,1 .venv/bin/python benchmarks/bench_training.py --preset small --batch 4 --seq-len 512
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def measure(args, mode: str, precision: str, rank: int = 0, world: int = 1) -> dict:
    """Median step time and peak memory of `args.steps` steps after two warm-up steps."""
    from astrai_pl.model import ModelConfig, Transformer
    from astrai_pl.parallel import apply_activation_checkpointing, apply_fsdp2

    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(args.preset)).to(device)
    apply_activation_checkpointing(model, mode)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        apply_fsdp2(model, init_device_mesh(device.type, (world,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = args.batch // world
    ids = torch.randint(0, model.config.vocab_size, (batch, args.seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    times, before = [], rss_gb()
    for step in range(args.steps + 2):
        if step == 2 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with autocast:
            logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else rss_gb() - before
    return {"step_s": statistics.median(times[2:]), "peak_gb": peak, "loss": float(loss)}


def _fsdp_worker(rank: int, world: int, args, port: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    threads = max(1, torch.get_num_threads() // world)
    torch.set_num_threads(threads)
    result = measure(args, "none", "32-true", rank, world)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def worker_main(args) -> None:
    if args.worker == "fsdp2":
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        mp.spawn(_fsdp_worker, args=(2, args, port, queue), nprocs=2, join=True)
        print(json.dumps(queue.get()))
    else:
        mode, precision = args.worker.split(":")
        print(json.dumps(measure(args, mode, precision)))


def fresh(args, worker: str) -> dict:
    """Run one configuration `--repeats` times, each in a new process; keep the fastest median step
    (the least disturbed by other work on the machine) and the first run's peak memory."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        worker,
        "--preset",
        args.preset,
        "--batch",
        str(args.batch),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
    ]
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {**runs[0], "step_s": min(r["step_s"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per configuration")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)

    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"{args.preset} preset, batch {args.batch} x {args.seq_len} tokens; per configuration the fastest of "
        f"{args.repeats} fresh processes, each the median of {args.steps} steps; {device}"
    )
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"  OMP_NUM_THREADS={threads} {os.path.relpath(sys.executable)} {' '.join(sys.argv)}")
    base = fresh(args, "none:32-true")
    print("activation checkpointing (32-true):")
    for mode in ("none", "full", "selective"):
        r = base if mode == "none" else fresh(args, f"{mode}:32-true")
        print(
            f"  {mode:<9}  step {r['step_s'] * 1e3:8.1f} ms ({r['step_s'] / base['step_s']:.2f}x)   "
            f"peak {r['peak_gb']:6.3f} GB ({r['peak_gb'] / max(base['peak_gb'], 1e-9):.2f}x)"
        )
    bf16 = fresh(args, "none:bf16-mixed")
    print("precision (no checkpointing):")
    print(f"  32-true     step {base['step_s'] * 1e3:8.1f} ms")
    print(
        f"  bf16-mixed  step {bf16['step_s'] * 1e3:8.1f} ms ({bf16['step_s'] / base['step_s']:.2f}x of 32-true)"
    )
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        print("FSDP2: needs 2 GPUs; skipped")
        return
    fsdp = fresh(args, "fsdp2")
    per_rank = max(1, torch.get_num_threads() // 2)
    print(f"FSDP2, same global batch: 1 process x {torch.get_num_threads()} threads vs 2 x {per_rank}:")
    print(f"  1 process   step {base['step_s'] * 1e3:8.1f} ms")
    print(
        f"  FSDP2 x2    step {fsdp['step_s'] * 1e3:8.1f} ms ({fsdp['step_s'] / base['step_s']:.2f}x of 1 process)"
    )


if __name__ == "__main__":
    main()
