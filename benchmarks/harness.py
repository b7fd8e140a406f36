"""What the peer benchmarks share: the model pair on one set of weights, the clock, interleaved
repetitions, and the result rows that `run_all.py` gathers into one table.

Every measure is a ratio between our code and a peer doing the same work in the same process, so
other load on the machine hits both. Repetitions alternate in ABBA order (ours, peer, peer, ours, …)
and the ratio is the median of the per-repetition ratios peer / ours: above 1 means we are faster.
Each repetition is timed twice, by the wall clock and by the process CPU clock (all threads). The
CPU-time ratio barely moves when another process takes the cores for a while, which the wall clock
cannot tell from slowness; it also counts serial Python work only once, not once per idle thread.
Both are reported; the wall-clock ratio is the headline.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2


def setup(threads: int = THREADS) -> None:
    """Same threads for every contestant, quiet peers."""
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "disabled")
    for name in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def machine() -> str:
    """CPU model, cores and torch version: the `machine` column."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


# -- timing ---------------------------------------------------------------------------------------------
@dataclass
class Sample:
    wall: float  # seconds
    cpu: float  # process CPU seconds, every thread


def clock(fn: Callable[[], object]) -> tuple[Sample, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return Sample(time.perf_counter() - wall, time.process_time() - cpu), out


@dataclass
class Duel:
    """Interleaved samples of ours and a peer; ratios are peer / ours per repetition, then the median."""

    ours: list[Sample] = field(default_factory=list)
    peer: list[Sample] = field(default_factory=list)

    def ratios(self, kind: str = "wall") -> list[float]:
        return sorted(getattr(p, kind) / getattr(o, kind) for o, p in zip(self.ours, self.peer))

    def ratio(self, kind: str = "wall") -> float:
        return statistics.median(self.ratios(kind))

    def median(self, side: str, kind: str = "wall") -> float:
        return statistics.median(getattr(s, kind) for s in getattr(self, side))

    def best_ratio(self) -> float:
        """Fastest peer run over our fastest: each side's least disturbed run."""
        return min(s.wall for s in self.peer) / min(s.wall for s in self.ours)

    def spread(self) -> str:
        r = self.ratios()
        return (f"{len(r)} interleaved runs each, per-run ratios {r[0]:.2f}-{r[-1]:.2f}, "
                f"best run over best run {self.best_ratio():.2f}x")


def duels(contestants: dict[str, Callable[[], object]], reps: int, warmup: int = 1,
          budget_s: float | None = None, min_reps: int = 3) -> dict[str, Duel]:
    """Ours (the first contestant) against each of the others, interleaved: the order of each round is
    the reverse of the last one's (ABBA). Stops after `reps` rounds, or earlier once `budget_s` seconds
    have passed and `min_reps` rounds are done (so a loaded machine cannot stretch a run without end)."""
    names = list(contestants)
    for _ in range(warmup):
        for name in names:
            contestants[name]()
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    start = time.perf_counter()
    for i in range(reps):
        if budget_s is not None and i >= min_reps and time.perf_counter() - start > budget_s:
            break
        for name in names if i % 2 == 0 else names[::-1]:
            samples[name].append(clock(contestants[name])[0])
    ours = names[0]
    return {name: Duel(samples[ours], samples[name]) for name in names[1:]}


def duel(ours: Callable[[], object], peer: Callable[[], object], reps: int, warmup: int = 1,
         budget_s: float | None = None) -> Duel:
    """`duels` of one peer. Pass warmup=0 after warming both up on a smaller job, to save time."""
    return duels({"ours": ours, "peer": peer}, reps, warmup, budget_s)["peer"]


# -- result rows ----------------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table: ours against one peer on one measure."""

    measure: str
    peer: str
    ratio: float | None  # wall clock, peer / ours (> 1: we are faster); None when not measured
    cpu_ratio: float | None = None
    detail: str = ""  # absolute figures behind the ratio
    command: str = ""
    target: float | None = None  # the ratio this measure must reach, if any
    note: str = ""  # why there is no ratio, or what else to know

    @property
    def ratio_text(self) -> str:
        if self.ratio is None:
            return self.note or "not measured"
        text = f"{self.ratio:.2f}x"
        if self.cpu_ratio is not None:
            text += f" (CPU time {self.cpu_ratio:.2f}x)"
        return text


def row_from(duel_: Duel, measure: str, peer: str, unit_work: float, unit: str, command: str,
             target: float | None = None) -> Row:
    """A row from a duel whose repetitions each do `unit_work` units (tokens, steps) of work."""
    ours_s, peer_s = duel_.median("ours"), duel_.median("peer")
    if unit == "s/step":
        detail = f"median ours {ours_s:.2f} s/step, peer {peer_s:.2f} s/step"
    else:
        detail = f"median ours {unit_work / ours_s:.1f} {unit}, peer {unit_work / peer_s:.1f} {unit}"
    detail += f"; {duel_.spread()}"
    return Row(measure, peer, duel_.ratio("wall"), duel_.ratio("cpu"), detail, command, target)


def emit(rows: list[Row]) -> None:
    for r in rows:
        print(f"  {r.measure} vs {r.peer}: {r.ratio_text}  [{r.detail}]", flush=True)


def save(rows: list[Row], path: str | None) -> None:
    """Write the rows as JSON for run_all.py (nothing without a path)."""
    if path:
        Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=1))


def command_line() -> str:
    """How this script was invoked, relative to the repository root."""
    script = os.path.relpath(sys.argv[0], ROOT)
    args = [a for i, a in enumerate(sys.argv[1:]) if a != "--json" and sys.argv[i] != "--json"]
    return " ".join(["python", script, *args])


# -- the model pair -------------------------------------------------------------------------------------
def small_model(seed: int = 0):
    """Our `small` preset: hidden 512, 8 layers, 8 query / 2 key-value heads, vocab 8192 (~31M parameters)."""
    from astrai_pl.model import ModelConfig, Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_name("small"))


def hf_copy(model):
    """transformers' LlamaForCausalLM with our weights, through our Hugging Face export."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    hf.generation_config.eos_token_id = None
    return hf.train(model.training)


@torch.no_grad()
def max_logit_gap(model, peer_logits: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> float:
    """max |our logits − the peer's| on one random batch: evidence that both hold the same weights."""
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    return float((model(ids).logits - peer_logits(ids)).abs().max())
