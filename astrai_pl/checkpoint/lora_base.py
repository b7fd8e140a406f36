"""Where a LoRA checkpoint's base is: what a run records of it, and where it is looked for when that is gone.

A LoRA run's checkpoint holds the adapter only; `lora_base` records the base it was trained on:

    init_from     the base's resolved absolute path (a `latest` pointer replaced by the run it named then)
    as_written    init_from as the config gave it (runs/pretrain-tiny/latest/checkpoints/last.ckpt)
    run           the run directory (version_N) the base belongs to, when it is one of a run's checkpoints
    fingerprint   weights_fingerprint of the base, checked whenever it is read again

When the recorded file is gone or holds other weights (the run directory was moved, last.ckpt kept training),
the checkpoints of that run root (`<root>/version_*/checkpoints/*.ckpt`) are searched for the fingerprint: the
root named by `init_from`, and `as_written` read from here and from every folder above the LoRA checkpoint (a
run trained elsewhere, or written before absolute paths were recorded). The first that matches is used, and one
log line names it; none matching is an error naming what was searched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .runs import LATEST, VERSION, resolve_latest

log = logging.getLogger(__name__)


def base_record(init_from: str, fingerprint: float) -> dict[str, Any]:
    """What a LoRA checkpoint records of the base in `init_from` (see the module's docstring)."""
    record: dict[str, Any] = {"init_from": init_from, "as_written": init_from, "fingerprint": fingerprint}
    local = Path(resolve_latest(init_from)) if "://" not in init_from else None
    if local is None or not local.exists():
        return record  # an address (or a name another reader resolves): kept as given
    path = local.resolve()
    record["init_from"] = str(path)
    run = next((p for p in (path, *path.parents) if VERSION.fullmatch(p.name)), None)
    if run is not None:
        record["run"] = run.name
    return record


def _root_of(path: Path) -> Path | None:
    """The run root in `path`: the folder holding its `latest` or version_N component."""
    parts = path.parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == LATEST or VERSION.fullmatch(parts[i]):
            return Path(*parts[:i])
    return None


def search_roots(ckpt: Path, record: dict[str, Any]) -> list[Path]:
    """Run roots that may hold the base: the recorded path's, and the as-written path's read from the current
    folder and from every folder above the LoRA checkpoint."""
    roots: list[Path] = []
    recorded = Path(str(record.get("init_from")))
    written = Path(str(record.get("as_written") or recorded))  # older checkpoints: init_from as written
    found = [_root_of(recorded)]
    if not written.is_absolute():
        found += [_root_of(anchor / written) for anchor in (Path.cwd(), *ckpt.resolve().parents)]
    for root in found:
        if root is not None and root.is_dir() and root.resolve() not in roots:
            roots.append(root.resolve())
    return roots


def candidates(ckpt: Path, record: dict[str, Any], skip: tuple[Path, ...]) -> Iterator[Path]:
    """The checkpoints of each run root, the recorded run's first, then the newest runs; `skip` (the files
    already tried or being read) left out."""
    seen = {p.resolve() for p in skip}
    for root in search_roots(ckpt, record):
        runs = sorted((p for p in root.iterdir() if p.is_dir() and VERSION.fullmatch(p.name)),
                      key=lambda p: (p.name != record.get("run"), -int(p.name.split("_")[1])))
        for run in runs:
            for path in sorted((run / "checkpoints").glob("*.ckpt"), key=lambda p: p.name != "last.ckpt"):
                if path.resolve() not in seen:
                    seen.add(path.resolve())
                    yield path


def peft_base(model: Any, folder: Path, tokenizer: Any, overwrite: bool) -> str:
    """The base an adapter exported from `model` names as base_model_name_or_path, so that PEFT's one call
    `AutoPeftModelForCausalLM.from_pretrained(adapter_dir)` loads it: the Hugging Face directory the base already
    is (its absolute path), a name that is no local path (a Hub id, as PEFT wrote it), else the base written as
    a Hugging Face directory into `folder`. Recorded in `model.adapter_extra`, which the adapter's
    save_pretrained writes; `astrai-pl convert` and the HFExport callback both name bases so."""
    from ..model.lora import base_of

    extra = model.__dict__.setdefault("adapter_extra", {})
    named = extra.get("base_model_name_or_path")
    if named and (Path(named) / "config.json").is_file():
        extra["base_model_name_or_path"] = str(Path(named).resolve())
    elif named and not Path(named).exists() and not str(named).endswith(".ckpt"):
        return str(named)
    else:
        base_of(model).save_pretrained(folder, tokenizer=tokenizer, overwrite=overwrite)
        extra["base_model_name_or_path"] = str(Path(folder).resolve())
    return extra["base_model_name_or_path"]


def note_found(ckpt: Path, recorded: str, found: Path, why: str) -> None:
    log.warning("%s: its LoRA base at %s %s; using %s, which holds the weights it was trained on "
                "(same fingerprint)", ckpt, recorded, why, found)
