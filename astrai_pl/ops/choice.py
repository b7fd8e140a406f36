"""How every run-time choice among kernels and libraries is made: prefill and decode attention in the engine,
packed-row attention in training, the fused lm_head loss and its weight-gradient accumulation.

A `Choice` holds the candidates, each with a check that says why it cannot run here (or None), and for each
device type the order in which they are tried by default. `choose(device, *args)` returns

1. the name forced inside `with override(name):` (this context only: tests, benchmarks), else
2. the name forced by `force(name)` (the whole process, until `force(None)`), else
3. the name in the environment variable, where the choice has one (`ASTRAI_PREFILL=flex`), else
4. the first candidate of the device's default order that can run.

A named candidate that cannot run (flash-attn not installed, a CPU device, float32) falls back to its stand-in
where it has one, else to the default order, and logs one line per process and reason. An unknown name
raises ValueError naming the choices.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar

import torch

log = logging.getLogger("astrai_pl.ops")

WhyNot = Callable[..., "str | None"]  # (device, *args) → why the candidate cannot run there, or None


class Choice:
    """One run-time choice (see the module docstring)."""

    def __init__(
        self, title: str, candidates: Mapping[str, WhyNot | None], defaults: Mapping[str, tuple[str, ...]], *,
        env: str | None = None, stand_ins: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None,
        logged: Callable[[], set[str]] | None = None,
    ) -> None:  # fmt: skip
        """`title` names the choice in errors and log lines; `candidates` maps each name to its check (None: it
        always runs); `defaults` maps a device type ("*": any other) to the names tried in order, the last of
        which always runs; `stand_ins` maps a name to what runs when it cannot; `labels` how its log line calls
        it (default "title name"); `logged` returns the set of lines already logged (default: the choice's own)."""
        assert "*" in defaults, "defaults need an entry for any device ('*')"
        self.title, self.candidates, self.defaults, self.env = title, dict(candidates), dict(defaults), env
        self.stand_ins, self.labels = dict(stand_ins or {}), dict(labels or {})
        own: set[str] = set()
        self.logged = logged or (lambda: own)
        self.forced: str | None = None
        self._context: ContextVar[str | None] = ContextVar(f"astrai_choice_{title}", default=None)

    def _checked(self, name: str | None) -> str | None:
        if name is not None and name not in self.candidates:
            raise ValueError(f"{self.title} {name!r}: choose one of {', '.join(self.candidates)}, or None")
        return name

    def force(self, name: str | None) -> None:
        """Use `name` for the rest of the process (None: back to the environment / default order)."""
        self.forced = self._checked(name)

    @contextlib.contextmanager
    def override(self, name: str | None) -> Iterator[None]:
        """Use `name` inside the block, in this context only (None: back to `force` / environment / default)."""
        token = self._context.set(self._checked(name))
        try:
            yield
        finally:
            self._context.reset(token)

    def named(self) -> str | None:
        """The name asked for by override, force or the environment variable, or None."""
        name = self._context.get() or self.forced
        if name is None and self.env:
            name = os.environ.get(self.env, "").strip().lower() or None
            if name is not None and name not in self.candidates:
                raise ValueError(f"{self.env}={name!r} is not one of {', '.join(self.candidates)}")
        return name

    def why_not(self, name: str, device: torch.device, *args) -> str | None:
        """Why candidate `name` cannot run on `device` with `args`, or None."""
        check = self.candidates[name]
        return None if check is None else check(device, *args)

    def choose(self, device: torch.device, *args) -> str:
        """The candidate that runs on `device` (args: what the checks also read, such as the dtype)."""
        device = torch.device(device)
        name = self.named()
        if name is not None:
            why = self.why_not(name, device, *args)
            if why is None:
                return name
            self.log_once(self.labels.get(name, f"{self.title} {name}"), why)
            if name in self.stand_ins:
                return self.stand_ins[name]
        order = self.defaults.get(device.type, self.defaults["*"])
        return next((n for n in order if self.why_not(n, device, *args) is None), order[-1])

    def log_once(self, what: str, why: str) -> None:
        """Log that `what` falls back, once per process and reason."""
        line = f"astrai_pl: {what} falls back ({why})"
        if line not in self.logged():
            self.logged().add(line)
            log.info("%s", line)
