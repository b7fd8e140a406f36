"""Run directories: every `astrai-pl fit` writes into a directory of its own, `<default_root_dir>/version_N/`
(metrics, config.yaml, checkpoints/, hf/), as Lightning's loggers number theirs, so reruns and sweep points never
replace each other's checkpoints. `<default_root_dir>/latest` names the newest run: a symlink to its directory,
or, where symlinks cannot be made, a small file holding its name (`version_3`), which every path astrai-pl
reads (init_from, --ckpt_path, --model) resolves the same way.

Which version a run takes: a new run claims the next number (mkdir, so two runs started together never share
one); `--ckpt_path last` continues the run `latest` names, in its own directory (its metrics.csv so far kept as
metrics.before-resume-1.csv); `--ckpt_path FILE` inside `<root>/version_N/checkpoints/` continues version_N.
`validate` and `test` take a directory of their own and leave `latest` on the newest training run.

The ranks of one run share its directory: the processes the trainer launches inherit ASTRAI_RUN_DIR from rank 0
(a launcher may set it for all); ranks that srun or torchrun start each on their own read rank 0's choice from
`<root>/.run-<job>` (SLURM's job and step ids, or torchrun's run id and master address), waiting for it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from ..model.hf import CheckpointError

LATEST = "latest"
RUN_DIR_ENV = "ASTRAI_RUN_DIR"
VERSION = re.compile(r"version_(\d+)")
STARTED = time.time()  # about when this process started: an older job file is another job's
JOB_WAIT_S = 600.0


def versions(root: Path) -> list[int]:
    """The numbers of the run directories under `root`, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := VERSION.fullmatch(p.name)))


def claim_run_dir(root: Path) -> Path:
    """Create and return `root/version_N` for the next free N; mkdir fails on a directory another run has just
    made, so the next number is tried."""
    root.mkdir(parents=True, exist_ok=True)
    number = (versions(root) or [-1])[-1] + 1
    while True:
        run_dir = root / f"version_{number}"
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            number += 1


def latest_run_dir(root: Path) -> Path | None:
    """The run `root/latest` names, else the highest-numbered one; None when `root` holds no run."""
    pointer = root / LATEST
    if pointer.is_symlink() or pointer.is_file():
        target = _pointed(pointer)
        if target.is_dir():
            return target
    numbers = versions(root)
    return root / f"version_{numbers[-1]}" if numbers else None


def point_latest(root: Path, run_dir: Path) -> None:
    """Make `root/latest` name `run_dir`: a relative symlink, replaced atomically; a file holding the name where
    the filesystem refuses symlinks."""
    pointer, spare = root / LATEST, root / f".{LATEST}.{os.getpid()}"
    spare.unlink(missing_ok=True)
    try:
        os.symlink(run_dir.name, spare, target_is_directory=True)
    except (OSError, NotImplementedError):
        spare.write_text(run_dir.name + "\n")
    if pointer.is_dir() and not pointer.is_symlink():
        raise CheckpointError(f"{pointer} is a directory, not the pointer to the latest run; move it away")
    os.replace(spare, pointer)


def _pointed(pointer: Path) -> Path:
    """The run directory a `latest` pointer file or symlink names. A file must hold one `version_N` name, so a
    pointer cannot lead out of its root."""
    if pointer.is_symlink():
        return pointer.resolve()
    name = pointer.read_text().strip()
    if not VERSION.fullmatch(name):
        raise CheckpointError(f"{pointer}: holds {name[:60]!r}, not the name of a run directory (version_N); "
                              "delete it, or write the name of the run it should point to")
    return pointer.parent / name


def resolve_latest(path: str | Path) -> str:
    """`path` with a `latest` pointer file in it replaced by the run directory it names (a symlink resolves by
    itself); addresses (`s3://…`) and paths without one come back unchanged."""
    text = str(path)
    if "://" in text or LATEST not in Path(text).parts:
        return text
    parts = Path(text).parts
    for i, part in enumerate(parts):
        prefix = Path(*parts[: i + 1])
        if part == LATEST and prefix.is_file():
            return str(_pointed(prefix).joinpath(*parts[i + 1:]))
    return text


def run_dir_for(root: Path, subcommand: str | None, ckpt_path: str | None) -> tuple[Path, bool]:
    """The run directory of this run and whether it is the newest training run (`latest` then points to it).

    `--ckpt_path last` continues the run `latest` names; a checkpoint inside `root/version_N/checkpoints/`
    continues version_N; anything else is a new run. A run of the layout before run directories (root/checkpoints)
    is named rather than silently restarted."""
    training = subcommand in (None, "fit")
    if ckpt_path == "last" and training:
        current = latest_run_dir(root)
        if current is not None:
            return _continued(current), True
        old = root / "checkpoints" / "last.ckpt"
        if old.exists():
            raise CheckpointError(f"ckpt_path='last': runs under {root} now live in version_N/ folders, and {old} "
                                  f"was written before. Fix: resume it with --ckpt_path {old}")
    elif ckpt_path and training:
        ckpt = Path(resolve_latest(ckpt_path)).resolve()
        run_dir = ckpt.parent.parent
        inside = run_dir.parent == root.resolve() and ckpt.parent.name == "checkpoints"
        if inside and VERSION.fullmatch(run_dir.name):
            return _continued(root / run_dir.name), True
    return claim_run_dir(root), training


def _continued(run_dir: Path) -> Path:
    """`run_dir`, its metrics.csv moved to metrics.before-resume-K.csv: Lightning's CSVLogger deletes the file it
    finds when it starts, and the steps before the resume stay readable."""
    metrics = run_dir / "metrics.csv"
    if metrics.is_file():
        k = 1
        while (run_dir / f"metrics.before-resume-{k}.csv").exists():
            k += 1
        os.replace(metrics, run_dir / f"metrics.before-resume-{k}.csv")
    return run_dir


def launched_rank() -> tuple[int, str] | None:
    """(rank, job key) of a process srun or torchrun started as one rank of several; None otherwise."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), f"slurm-{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID', '0')}"
    if int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
        return int(env["RANK"]), (f"torchrun-{env['TORCHELASTIC_RUN_ID']}-{env.get('MASTER_ADDR')}-"
                                  f"{env.get('MASTER_PORT')}")
    return None


def job_record(root: Path, key: str) -> Path:
    """The file in which rank 0 of job `key` names its run directory."""
    return root / f".run-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}"


def _job_run_dir(root: Path, key: str) -> Path:
    """The run directory rank 0 of job `key` wrote to its job record, waiting up to JOB_WAIT_S for it."""
    record, deadline = job_record(root, key), time.monotonic() + JOB_WAIT_S
    while time.monotonic() < deadline:
        if record.is_file() and record.stat().st_mtime >= STARTED - 120:
            name = record.read_text().strip()
            if VERSION.fullmatch(name):
                return root / name
        time.sleep(0.5)
    raise CheckpointError(f"{record}: rank 0 of this job did not name its run directory within {JOB_WAIT_S:.0f} s; "
                          f"set {RUN_DIR_ENV}=<default_root_dir>/version_N for every rank")


def shared_run_dir(root: Path, subcommand: str | None, ckpt_path: str | None) -> Path:
    """This process's run directory: ASTRAI_RUN_DIR when set (the run's other ranks, or a launcher's choice),
    rank 0's choice on the other ranks of an srun / torchrun job, else chosen here (run_dir_for) and exported
    for the ranks the trainer launches; `latest` moves on rank 0."""
    inherited, launched = os.environ.get(RUN_DIR_ENV), launched_rank()
    if inherited:
        run_dir = Path(inherited)
    elif launched is not None and launched[0] != 0:
        run_dir = _job_run_dir(root, launched[1])
    else:
        run_dir, newest = run_dir_for(root, subcommand, ckpt_path)
        if newest:
            point_latest(root, run_dir)
        if launched is not None:
            record = job_record(root, launched[1])
            spare = record.with_name(record.name + ".tmp")
            spare.write_text(run_dir.name + "\n")
            os.replace(spare, record)
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ[RUN_DIR_ENV] = str(run_dir)
    return run_dir
