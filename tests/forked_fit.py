"""`astrai-pl fit` runs forked from one process that has imported the CLI already: importing it (Lightning,
torchmetrics, transformers) costs about 12 s of CPU, far more than a few steps of the debug preset, so tests
that launch three runs each (a reference, a run killed with SIGKILL, its resumption) fork them from a
multiprocessing fork server that paid the import once. Each run gets a session of its own (so
`os.killpg(run.pid, SIGKILL)` kills it as it would a `python -m astrai_pl.cli fit` process), its config's
folder as working directory, one intra-op thread and its output in run.log; it runs `astrai_pl.cli.main`,
which is what `python -m astrai_pl.cli` runs."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["astrai_pl.cli", "forked_fit"])


def _run(folder: str, argv: list[str], port: str) -> None:
    os.setsid()
    os.chdir(folder)
    log = os.open("run.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(OMP_NUM_THREADS="1", MASTER_PORT=port)
    import torch

    torch.set_num_threads(1)
    from astrai_pl.cli import main

    sys.argv = argv
    main()


class ForkedRun:
    """What the tests ask of a `subprocess.Popen`: pid, args, poll, wait and returncode."""

    def __init__(self, process: mp.Process, args: list[str]):
        self.process, self.args, self.pid = process, args, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode


def launch_forked(config: Path, *args: str) -> ForkedRun:
    """Start `astrai-pl fit --config config …` in the config's folder, forked from the fork server (started
    here the first time, with one OpenMP thread)."""
    from fit_runs import free_port

    argv = ["astrai-pl", "fit", "--config", str(config), *args]
    process = _CONTEXT.Process(target=_run, args=(str(config.parent), argv, str(free_port())), daemon=False)
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read when the fork server imports torch
    try:
        process.start()
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    return ForkedRun(process, argv)
