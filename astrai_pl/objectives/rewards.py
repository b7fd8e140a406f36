"""Reward functions for GRPO: plain callables, chosen by import path, combined with weights.

A reward function has TRL's signature, so functions written for TRL work unchanged:

    f(prompts, completions, **columns) -> list[float | None]

It is called with keyword arguments, one list entry per completion: `prompts` (each prompt repeated
once per sample of its group: text, or messages for conversational rows), `completions` (the generated
text without the stop token; for conversational prompts `[{"role": "assistant", "content": text}]`),
`completion_ids` (generated ids, stop token included) and every other column of the data rows, repeated
alike (e.g. `answer`). A function may ignore what it does not read through `**kwargs`. `None` (or NaN)
means "does not apply to this completion": that entry counts 0 in the weighted sum and is left out of
the function's mean and std.

In YAML a function is its import path, or `{path: …, kwargs: {…}}` to bind keyword arguments:

    reward_funcs:
      - astrai_pl.objectives.rewards.exact_match_reward
      - {path: astrai_pl.objectives.rewards.length_penalty, kwargs: {target: 8, scale: 8.0}}
    reward_weights: [1.0, 0.1]
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..data.synthetic import exact_match, extract_answer
from ..model.config import finite_number

RewardFunc = Callable[..., list]
RewardSpec = str | dict[str, Any]

_INTEGER = re.compile(r"\s*-?\d+\s*")


class RewardError(ValueError):
    """A reward function cannot be loaded, raised, or returned something other than one number per completion."""


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of a completion, given as a string or as messages (the last message's content)."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


# -- built-in reward functions -----------------------------------------------------------------------

def exact_match_reward(prompts: list, completions: list, answer: list, **kwargs) -> list[float | None]:
    """1.0 when the last integer of the completion equals the row's `answer`, else 0.0 (the arithmetic task).
    None for rows without an answer."""
    return [None if a is None else exact_match(completion_text(c), a) for c, a in zip(completions, answer)]


def closeness_reward(prompts: list, completions: list, answer: list, scale: float = 10.0,
                     **kwargs) -> list[float | None]:
    """max(0, 1 − |x − answer| / scale) for the completion's last integer x, 0.0 without one: partial credit
    that keeps a weak policy's groups from scoring all alike. None for rows without an answer."""
    if scale <= 0:
        raise ValueError(f"closeness_reward: scale={scale} must be > 0")
    out: list[float | None] = []
    for c, a in zip(completions, answer):
        x = extract_answer(completion_text(c))
        out.append(None if a is None else 0.0 if x is None else max(0.0, 1 - abs(int(x) - int(a)) / scale))
    return out


def format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is one integer and nothing else (the arithmetic task's answer format), else 0.0."""
    return [float(_INTEGER.fullmatch(completion_text(c)) is not None) for c in completions]


def length_penalty(prompts: list, completions: list, completion_ids: list, target: int = 32, scale: float = 32.0,
                   **kwargs) -> list[float]:
    """0 up to `target` generated tokens, then −(n − target) / scale, floored at −1.

    Penalises rambling past a length budget without touching completions inside it (in the spirit of
    DAPO's soft overlong punishment, Yu et al., 2025). Lengths count the stop token.
    """
    if target < 0 or scale <= 0:
        raise ValueError(f"length_penalty: target={target} must be >= 0 and scale={scale} > 0")
    return [-min(1.0, max(0, len(ids) - target) / scale) for ids in completion_ids]


# -- loading -------------------------------------------------------------------------------------------

def _import(path: str, where: str) -> Callable:
    module_name, _, attr = path.rpartition(".")
    example = "e.g. 'astrai_pl.objectives.rewards.exact_match_reward'"
    if not module_name:
        raise RewardError(f"{where}={path!r} is not an import path; give 'package.module.function', {example}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise RewardError(f"{where}={path!r}: cannot import module {module_name!r} ({err}); "
                          f"give the import path of a function, {example}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"{where}={path!r}: module {module_name!r} has no attribute {attr!r}; "
                          f"check the spelling, {example}")
    if not callable(fn):
        raise RewardError(f"{where}={path!r} is a {type(fn).__name__}, not a function")
    return fn


def load_reward_func(spec: RewardSpec | Callable, where: str = "reward_funcs[0]") -> tuple[str, RewardFunc]:
    """(name, function) from an import path, a `{path, kwargs}` dict or a callable. The name keys the metrics."""
    if callable(spec):
        fn = spec
    elif isinstance(spec, str):
        fn = _import(spec, where)
    elif isinstance(spec, dict) and isinstance(spec.get("path"), str) and set(spec) <= {"path", "kwargs"}:
        fn = functools.partial(_import(spec["path"], f"{where}.path"), **(spec.get("kwargs") or {}))
    else:
        raise RewardError(f"{where}={spec!r}: give an import path or {{path: 'package.module.function', "
                          "kwargs: {…}}")
    base = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(base, "__name__", type(base).__name__), fn


def load_reward_funcs(specs: Sequence[RewardSpec | Callable], weights: Sequence[float] | None = None,
                      owner: str = "GRPO") -> tuple[list[tuple[str, RewardFunc]], list[float]]:
    """Every function of `specs` with a unique name, and their weights (all 1.0 when `weights` is None)."""
    if not specs:
        raise RewardError(f"{owner}.reward_funcs is empty; give at least one import path, "
                          "e.g. ['astrai_pl.objectives.rewards.exact_match_reward']")
    funcs, seen = [], {}
    for i, spec in enumerate(specs):
        name, fn = load_reward_func(spec, f"{owner}.reward_funcs[{i}]")
        seen[name] = seen.get(name, 0) + 1
        funcs.append((name if seen[name] == 1 else f"{name}_{seen[name]}", fn))
    weights = [1.0] * len(funcs) if weights is None else [_weight(w, f"{owner}.reward_weights[{i}]")
                                                          for i, w in enumerate(weights)]
    if len(weights) != len(funcs):
        raise RewardError(f"{owner}.reward_weights has {len(weights)} entries for {len(funcs)} reward_funcs; "
                          "give one weight per function, or null for all 1.0")
    return funcs, weights


def _weight(value: Any, where: str) -> float:
    """A reward weight as a finite float: a NaN weight would zero its function's share of every total."""
    weight = finite_number(value)
    if weight is None:
        raise RewardError(f"{where}={value!r}: a reward weight must be a finite number; give e.g. 1.0, or 0.0 "
                          "to log a function without training on it")
    return weight


def spec_name(spec: RewardSpec | Callable) -> RewardSpec:
    """A plain, checkpoint-safe form of a spec: callables become their import path."""
    if not callable(spec):
        return spec
    base = spec.func if isinstance(spec, functools.partial) else spec
    return f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', type(base).__name__)}"


# -- scoring -------------------------------------------------------------------------------------------

def call_reward(name: str, fn: RewardFunc, prompts: list, completions: list, columns: dict[str, list]) -> list[float]:
    """One function's rewards as floats, NaN for None; any failure is a RewardError naming the function."""
    try:
        values = fn(prompts=prompts, completions=completions, **columns)
    except Exception as err:
        raise RewardError(f"reward function {name!r} raised {type(err).__name__}: {err}; it is called as "
                          f"{name}(prompts, completions, {', '.join(columns)}) with one entry per "
                          "completion") from err
    try:
        count = len(values)
    except TypeError:
        raise RewardError(f"reward function {name!r} returned a {type(values).__name__}; it must return a "
                          f"list of {len(completions)} floats (or None)") from None
    if count != len(completions):
        raise RewardError(f"reward function {name!r} returned {count} rewards for {len(completions)} "
                          "completions; return exactly one float (or None) per completion")
    out = []
    for i, v in enumerate(values):
        try:
            x = math.nan if v is None else float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name!r} returned {v!r} at index {i}; each reward must be a "
                              "number or None") from None
        if math.isinf(x):
            raise RewardError(f"reward function {name!r} returned {x} at index {i}; rewards must be finite")
        out.append(x)
    return out


def score(funcs: Sequence[tuple[str, RewardFunc]], weights: Sequence[float], prompts: list, completions: list,
          columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-function rewards (N, F) with NaN where a function returned None, and their weighted sum (N,).

        R_i = Σ_f w_f · r_{i,f}   over the functions f whose r_{i,f} is not None
    """
    per_func = torch.tensor([call_reward(name, fn, prompts, completions, columns) for name, fn in funcs],
                            dtype=torch.float32).T.contiguous()  # (N, F)
    total = (per_func * torch.tensor(weights, dtype=torch.float32)).nansum(dim=1)  # (N,)
    unscored = int(per_func.isnan().all(dim=1).sum())
    if unscored:
        warnings.warn(f"{unscored} of {len(completions)} completions got None from every reward function "
                      f"({', '.join(n for n, _ in funcs)}); they count as reward 0", stacklevel=2)
    return per_func, total


def reward_metrics(names: Sequence[str], per_func: torch.Tensor, total: torch.Tensor,
                   group_size: int) -> dict[str, float]:
    """TRL's reward metrics: rewards/<name>/mean and /std (over non-None entries), reward (mean total),
    reward_std (mean within-group std of the total) and frac_reward_zero_std (groups whose completions all
    scored the same: their advantages are 0, they teach nothing). Standard deviations are population ones."""
    metrics: dict[str, float] = {}
    for j, name in enumerate(names):
        col = per_func[:, j]
        col = col[~col.isnan()]
        metrics[f"rewards/{name}/mean"] = float(col.mean()) if len(col) else math.nan
        metrics[f"rewards/{name}/std"] = float(col.std(unbiased=False)) if len(col) else math.nan
    group_std = total.view(-1, group_size).std(dim=1, unbiased=False)  # (N / G,)
    metrics["reward"] = float(total.mean())
    metrics["reward_std"] = float(group_std.mean())
    metrics["frac_reward_zero_std"] = float(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean())
    return metrics
