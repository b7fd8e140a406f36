"""Peak memory of one piece of work, each in a fresh process: what the memory benchmarks share.

On CPU a process's peak is its resident set's high-water mark (VmHWM in /proc/self/status). Each worker
imports its libraries first, then `start()` resets the mark to the current resident set (writing 5 to
/proc/self/clear_refs, Linux 4.0+) and records that resident set; `rise_mb()` after the work is the peak
minus that start: the model, its gradients, the optimizer state and the activations, without the
interpreter and the imported libraries. On CUDA it is `torch.cuda.max_memory_allocated` over the same
span (the caching allocator's reserve is left out).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} line: peak memory needs Linux's /proc")
    return int(match.group(1))


class PeakMemory:
    """`start()` before building the model, `rise_mb()` after the last step."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.start_kb = 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = torch.cuda.memory_allocated()
            return
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.start_kb = _status_kb("VmRSS")
        if _status_kb("VmHWM") > self.start_kb + 1024:
            raise RuntimeError("the peak resident set could not be reset (/proc/self/clear_refs): no peak measured")

    def rise_mb(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.start_bytes) / 2**20
        return (_status_kb("VmHWM") - self.start_kb) / 1024

    @property
    def method(self) -> str:
        if self.cuda:
            return "CUDA max_memory_allocated rise"
        return "peak RSS (VmHWM) rise over the RSS after imports, fresh process each"


def in_fresh_process(script: str, *args: str) -> dict:
    """Run `script --worker …` in a new interpreter and return the JSON object its last line prints."""
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    if done.returncode:
        command = f"{Path(script).name} {' '.join(args)}"
        raise RuntimeError(f"{command} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
