"""Operations on RWKV states as values: zero states, blending, editing, magnitudes and divergence.

A state's layer holds the token shifts (ffn_shift, att_shift) and the wkv sums kept scaled: the numerator
a = aa·e^{pp} and the denominator b = bb·e^{pp} (rwkv.py). Everything here works on those unscaled sums —
a blend interpolates a and b, a distance compares them — while never forming e^{pp} where it could overflow:
two states are brought to a common exponent first. No function writes into a tensor it was given, so states
may share tensors (a fork shares all of its parent's until one of them moves on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...model.rwkv import NO_EXPONENT, LayerState, RwkvState

EDITABLE = ("ffn_shift", "att_shift", "aa", "bb", "history")
"""What `scale_state` scales: a token shift, the numerator a (aa), the denominator b (bb), or both sums
together (history: the seed's decay_state, a uniform fade of everything before the next token)."""
MEASURED = ("ffn_shift", "att_shift", "numerator", "denominator")
"""The components `state_stats` and `state_distance` report: the shifts, and a and b unscaled."""


def zero_layers(model, rows: int = 1) -> list[LayerState]:
    """The state before any token, as explicit tensors (a forward given an empty RwkvState starts here)."""
    weight = model.embed_tokens.weight
    h, dtype, device = model.config.hidden_size, weight.dtype, weight.device
    shift = torch.zeros(rows, h, dtype=dtype, device=device)
    zero = torch.zeros(rows, h, dtype=torch.float32, device=device)
    empty = torch.full((rows, h), NO_EXPONENT, dtype=torch.float32, device=device)
    return [LayerState(shift, shift, zero, zero, empty) for _ in range(model.config.num_hidden_layers)]


def layers_of(model, layers: list[LayerState], rows: int = 1) -> list[LayerState]:
    """`layers`, or the zero state's when there are none (a fresh RwkvState)."""
    return layers if layers else zero_layers(model, rows)


def stack_states(states: list[list[LayerState]]) -> RwkvState:
    """One batched state whose row i is states[i] (each a one-row state)."""
    return RwkvState([LayerState(*(torch.cat(parts) for parts in zip(*layer))) for layer in zip(*states)])


def row_of(state: RwkvState, row: int) -> list[LayerState]:
    """Row `row` of a batched state, copied out so the batch's storage can go."""
    return [LayerState(*(t[row : row + 1].clone() for t in layer)) for layer in state.layers]


def rows_of(state: RwkvState, rows: torch.Tensor) -> RwkvState:
    return RwkvState([LayerState(*(t.index_select(0, rows) for t in layer)) for layer in state.layers])


# -- blending -----------------------------------------------------------------------------------------------
def blend_layers(x: list[LayerState], y: list[LayerState], alpha: float) -> list[LayerState]:
    """(1 − α)·x + α·y, componentwise: the shifts linearly (torch.lerp, exact at α = 0 and 1), the sums a and
    b as the same combination of the unscaled values, computed in log space:
        p = max(pp_x + ln(1−α), pp_y + ln α)      (a weight of 0 drops its state: ln 0 = −inf)
        aa = aa_x·e^{pp_x + ln(1−α) − p} + aa_y·e^{pp_y + ln α − p},  bb likewise,  pp = p
    so nothing overflows however large the exponents, and α = 0 or 1 returns that state's aa, bb, pp exactly."""
    log_x = math.log1p(-alpha) if alpha < 1 else -math.inf
    log_y = math.log(alpha) if alpha > 0 else -math.inf
    out = []
    for a, b in zip(x, y):
        px, py = a.pp + log_x, b.pp + log_y
        p = torch.maximum(px, py)
        ex, ey = torch.exp(px - p), torch.exp(py - p)
        aa, bb = a.aa * ex + b.aa * ey, a.bb * ex + b.bb * ey
        out.append(LayerState(torch.lerp(a.ffn_shift, b.ffn_shift, alpha), torch.lerp(a.att_shift, b.att_shift, alpha),
                              aa, bb, p))
    return out


# -- editing ------------------------------------------------------------------------------------------------
def scale_layers(layers: list[LayerState], component: str, factor: float, which: set[int]) -> list[LayerState]:
    """`layers` with `component` (one of EDITABLE) multiplied by `factor` in the layers `which`. history scales a
    and b by moving the exponent (pp + ln factor), so it never overflows; a factor of 0 empties them."""
    out = []
    for i, layer in enumerate(layers):
        if i not in which:
            out.append(layer)
        elif component == "history" and factor == 0:
            out.append(layer._replace(aa=torch.zeros_like(layer.aa), bb=torch.zeros_like(layer.bb),
                                      pp=torch.full_like(layer.pp, NO_EXPONENT)))
        elif component == "history":
            out.append(layer._replace(pp=torch.clamp_min(layer.pp + math.log(factor), NO_EXPONENT)))
        else:
            out.append(layer._replace(**{component: getattr(layer, component) * factor}))
    return out


def check_edit(component: str, factor, layers, num_layers: int) -> set[int]:
    """The layer indices an edit touches, or a ValueError naming what is wrong."""
    if component not in EDITABLE:
        raise ValueError(f"component={component!r} is not a part of the state; pick one of {EDITABLE}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise ValueError(f"factor={factor!r} must be a finite number")
    if component in ("bb", "history") and factor < 0:
        raise ValueError(f"factor={factor} for {component}: the denominator is a sum of positive terms, so it "
                         "takes a factor >= 0 (scale aa alone to flip the numerator)")
    chosen = range(num_layers) if layers is None else layers
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layers holds {bad[0]!r}; the model has layers 0..{num_layers - 1}")
    return set(chosen)


# -- magnitudes and divergence ------------------------------------------------------------------------------
def unscaled(layer: LayerState, reference: torch.Tensor | float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """a·e^{−reference} and b·e^{−reference} in float64, one row flattened; with the default reference, a and
    b themselves (infinite only if the exponent passes float64's range, e^709)."""
    scale = torch.exp(layer.pp.double() - reference)
    return (layer.aa.double() * scale).flatten(), (layer.bb.double() * scale).flatten()


def components(layer: LayerState, reference: torch.Tensor | float = 0.0) -> dict[str, torch.Tensor]:
    a, b = unscaled(layer, reference)
    return {"ffn_shift": layer.ffn_shift.double().flatten(), "att_shift": layer.att_shift.double().flatten(),
            "numerator": a, "denominator": b}


@dataclass(frozen=True)
class ComponentStats:
    """Magnitudes of one component of one layer (over its channels): mean |x|, max |x| and the L2 norm."""

    layer: int
    component: str
    mean_abs: float
    max_abs: float
    l2: float


@dataclass(frozen=True)
class ComponentDistance:
    """How far apart one component of one layer is in two states: the L2 norm of the difference and the
    cosine similarity (1 when both are zero, 0 when only one is)."""

    layer: int
    component: str
    l2: float
    cosine: float


@dataclass(frozen=True)
class StateReport:
    """Rows of ComponentStats or ComponentDistance, one per layer and component (a DataFrame takes them)."""

    rows: list

    def table(self) -> str:
        names = list(self.rows[0].__dataclass_fields__) if self.rows else []
        lines = ["  ".join(f"{n:>11}" for n in names)]
        for row in self.rows:
            cells = (getattr(row, n) for n in names)
            lines.append("  ".join(f"{c:>11.4g}" if isinstance(c, float) else f"{c!s:>11}" for c in cells))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def state_stats(layers: list[LayerState]) -> StateReport:
    rows = []
    for i, layer in enumerate(layers):
        for name, x in components(layer).items():
            m = x.abs()
            rows.append(ComponentStats(i, name, float(m.mean()), float(m.max()), float(x.norm())))
    return StateReport(rows)


def state_distance(x: list[LayerState], y: list[LayerState]) -> StateReport:
    """Per layer and component, L2 and cosine between two states' shifts and unscaled sums a, b. The cosine
    uses a per-layer common exponent (the largest pp of either state) so it stays finite; the L2 of a and b
    is that distance times e^{exponent}, in float64."""
    rows = []
    for i, (lx, ly) in enumerate(zip(x, y)):
        reference = torch.maximum(lx.pp.max(), ly.pp.max()).double()
        cx, cy = components(lx, reference), components(ly, reference)
        for name in MEASURED:
            u, v = cx[name], cy[name]
            diff = float((u - v).norm())
            if name in ("numerator", "denominator") and diff:
                diff = diff * math.exp(float(reference)) if reference < 709 else math.inf
            rows.append(ComponentDistance(i, name, diff, _cosine(u, v)))
    return StateReport(rows)


def _cosine(u: torch.Tensor, v: torch.Tensor) -> float:
    nu, nv = float(u.norm()), float(v.norm())
    if nu == 0 or nv == 0:
        return 1.0 if nu == nv else 0.0
    return float(torch.dot(u, v)) / (nu * nv)
