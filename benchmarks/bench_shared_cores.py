"""The demo's first two stages, shortened, under each OpenMP setting, alone and beside a one-core CPU burner.

Each run is its own process (OMP_WAIT_POLICY only takes effect before torch is imported): `--pretrain-steps`
steps of configs/pretrain/tiny.yaml, then `--sft-steps` of configs/sft/tiny.yaml from its checkpoint, in a
scratch folder. For each setting it runs alone, then at once beside `python -c "while True: pass"`, so the
two runs of a pair see the machine's other load as nearly alike as they can; it prints each run's training
seconds (the two `fit` calls, set-up left out), its CPU seconds (the process's, set-up included), the load
average before it, and the slowdown the burner caused.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_shared_cores.py --rounds 2
    .venv/bin/python benchmarks/bench_shared_cores.py --settings PASSIVE:2 ACTIVE:2 --pretrain-steps 10 --sft-steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One run, in the child: the wait policy as asked, then torch, then the two stages.
CHILD = """
import json, os, resource, sys, time
policy, threads, pretrain_steps, sft_steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
import astrai_pl  # sets OMP_WAIT_POLICY=PASSIVE unless set
if policy == "unset":
    os.environ.pop("OMP_WAIT_POLICY", None)
else:
    os.environ["OMP_WAIT_POLICY"] = policy
import torch
torch.set_num_threads(threads)
from astrai_pl.cli import lightning_main
quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
seconds, ckpt = {}, None
for stage, steps in (("pretrain", pretrain_steps), ("sft", sft_steps)):
    extra = [] if ckpt is None else ["--model.init_args.init_from", ckpt]
    cli = lightning_main(["--config", f"configs/{stage}/tiny.yaml", "--trainer.max_steps", steps, *extra, *quiet],
                         run=False)
    t0 = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seconds[stage] = time.perf_counter() - t0
    ckpt = cli.trainer.checkpoint_callback.last_model_path
usage = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT " + json.dumps({**seconds, "cpu": usage.ru_utime + usage.ru_stime, "threads": torch.get_num_threads(),
                              "cores": len(os.sched_getaffinity(0))}), flush=True)
"""


def run(policy: str, threads: int, args: argparse.Namespace, folder: Path, burner: bool) -> dict:
    """One child run (beside a burner process when `burner`); its RESULT with the load average before it."""
    load = os.getloadavg()[0]
    burn = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if burner else None
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, policy, str(threads), str(args.pretrain_steps),
                               str(args.sft_steps)], cwd=folder, capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"load": load, "timed_out": True}
    finally:
        if burn is not None:
            burn.kill()
            burn.wait()
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{policy}:{threads} failed:\n{done.stderr[-3000:]}")
    return {"load": load, **json.loads(lines[-1][len("RESULT "):])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["PASSIVE:2", "unset:2", "PASSIVE:1", "ACTIVE:2"],
                        help="POLICY:THREADS, POLICY one of PASSIVE, ACTIVE, unset")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pretrain-steps", type=int, default=20)
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before one run counts as timed out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        (folder / "configs").symlink_to(ROOT / "configs")  # the configs name their runs/ relative to here
        print("setting     burner  load  train s  cpu s  slowdown")
        for _ in range(args.rounds):
            for setting in args.settings:
                policy, _, threads = setting.partition(":")
                alone = run(policy, int(threads), args, folder, burner=False)
                beside = run(policy, int(threads), args, folder, burner=True)
                for name, r in (("no", alone), ("yes", beside)):
                    train = r.get("pretrain", 0) + r.get("sft", 0)
                    slowdown = "" if name == "no" or "timed_out" in r or "timed_out" in alone else \
                        f"{train / (alone['pretrain'] + alone['sft']):.2f}x"
                    shown = "timed out" if "timed_out" in r else f"{train:7.1f}  {r['cpu']:5.1f}"
                    print(f"{setting:<11} {name:<6} {r['load']:5.1f}  {shown}  {slowdown}", flush=True)


if __name__ == "__main__":
    main()
