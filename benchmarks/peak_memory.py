"""Peak memory of one piece of work, each in a fresh process: what the memory benchmarks share.

On CPU a process's peak is its resident set's high-water mark (VmHWM in /proc/self/status). Each worker
imports its libraries first, then `start()` resets the mark to the current resident set (writing 5 to
/proc/self/clear_refs, Linux 4.0+) and records that resident set; `rise_mb()` after the work is the peak
minus that start: the model, its gradients, the optimizer state and the activations, without the
interpreter and the imported libraries. `reset_peak()` between building and stepping separates the two:
the steps' peak is then what training holds (weights, optimizer state, activations), whatever loading
needed for a moment. On CUDA it is `torch.cuda.max_memory_allocated` over the same
span (the caching allocator's reserve is left out).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} line: peak memory needs Linux's /proc")
    return int(match.group(1))


class PeakMemory:
    """`start()` before building the model, `rise_mb()` after the last step (`reset_peak()` in between to
    leave the build out of the peak)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.start_kb = self.start_bytes = 0

    def start(self) -> None:
        """The baseline: what the process holds now. Every later rise is over it."""
        self.reset_peak()
        self.start_bytes = torch.cuda.memory_allocated() if self.cuda else 0
        self.start_kb = 0 if self.cuda else _status_kb("VmRSS")

    def reset_peak(self) -> None:
        """Forget the peak so far (the baseline stays): the next `rise_mb()` covers only what follows."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        if _status_kb("VmHWM") > _status_kb("VmRSS") + 1024:
            raise RuntimeError("the peak resident set could not be reset (/proc/self/clear_refs): no peak measured")

    def rise_mb(self) -> float:
        """The peak since `start()` or the last `reset_peak()`, minus the baseline, in MiB."""
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.start_bytes) / 2**20
        return (_status_kb("VmHWM") - self.start_kb) / 1024

    @property
    def method(self) -> str:
        if self.cuda:
            return "CUDA max_memory_allocated rise"
        return "peak RSS (VmHWM) rise over the RSS after imports, fresh process each"


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without one storage (NF4)
        return None


def _subclass_bytes(t: torch.Tensor) -> int:
    """Bytes of a wrapper subclass's inner tensors (torch's __tensor_flatten__ protocol)."""
    names, _ = t.__tensor_flatten__()
    return sum(_subclass_bytes(getattr(t, n)) if _storage_key(getattr(t, n)) is None else getattr(t, n).nbytes
               for n in names)


def tensor_mb(tensors: Iterable[torch.Tensor]) -> float:
    """MiB the tensors hold, NF4 weights as their packed inner tensors, each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        key = _storage_key(t)
        if key is None:
            seen[id(t)] = _subclass_bytes(t)
        else:
            seen[key[0]] = key[1]
    return sum(seen.values()) / 2**20


def saved_for_backward_mb(step: Callable[[], object], params: Iterable[torch.Tensor]) -> float:
    """MiB of the distinct tensors autograd keeps for the backward pass while `step()` runs its forward,
    leaving out the parameters and what shares their storage (weights are held anyway): the activations,
    and any copy of a weight made for a matmul (a dequantised NF4 weight, say). Counted, not sampled from
    the allocator, so the figure does not move between runs."""
    params = list(params)
    held_ids = {id(p) for p in params}
    held = {key[0] for key in map(_storage_key, params) if key is not None}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if id(t) in held_ids or key is not None and key[0] in held:
            return t
        if key is None:
            seen[id(t)] = _subclass_bytes(t)
        else:
            seen[key[0]] = key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values()) / 2**20


def add_worker_arguments(parser, sides) -> None:
    """The hidden `--worker SIDE --folder DIR` a script passes to itself for `in_fresh_process`."""
    import argparse

    parser.add_argument("--worker", choices=list(sides), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)


def answer_as_worker(args, work) -> bool:
    """In a worker process (`--worker` given): print `work(side, folder)` as the JSON line `in_fresh_process`
    reads, and say so; False in the parent."""
    if not args.worker:
        return False
    print(json.dumps(work(args.worker, args.folder)))
    return True


def in_fresh_process(script: str, *args: str) -> dict:
    """Run `script --worker …` in a new interpreter and return the JSON object its last line prints."""
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    if done.returncode:
        command = f"{Path(script).name} {' '.join(args)}"
        raise RuntimeError(f"{command} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
