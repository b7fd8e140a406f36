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

An `async def` function is awaited: all the async functions of a rollout run concurrently on one event
loop of their own (a thread, so a notebook's running loop is no obstacle), while the plain ones run in turn.

In YAML a function is its import path, or `{path: …, kwargs: {…}}` to bind keyword arguments, or the
directory of a Hugging Face sequence-classification model with one label (a reward model), which scores
the prompt followed by the completion (`SequenceClassifierReward`; kwargs as its constructor's):

    reward_funcs:
      - astrai_pl.objectives.rewards.exact_match_reward
      - {path: astrai_pl.objectives.rewards.length_penalty, kwargs: {target: 8, scale: 8.0}}
      - {path: runs/rm-tiny/export, kwargs: {batch_size: 16}}
    reward_weights: [1.0, 0.1, 1.0]
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
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


# -- a reward model as a reward function ----------------------------------------------------------------

class SequenceClassifierReward:
    """The score of a Hugging Face sequence-classification model with one label (a reward model) for each
    prompt followed by its completion, as a reward function.

    The directory is read by `transformers` (AutoModelForSequenceClassification) with trust_remote_code=False,
    safetensors weights only and no download, so nothing in it runs as code; its tokenizer by our own loader
    (tokenizer.json, a sandboxed chat template). A conversational prompt is rendered with the directory's
    chat template, the completion as the assistant's turn; a plain one is prompt + completion text. Either
    starts with the tokenizer's BOS once, as every training row does, and keeps its last `max_length` tokens
    (default: the model's max_position_embeddings), where the score is read. Sequences are scored
    `batch_size` at a time, right-padded with the config's pad_token_id (one at a time without one), in
    inference mode on `device` (default: the current CUDA device if any, else the CPU).
    """

    def __init__(self, path: str | Path, batch_size: int = 8, max_length: int | None = None,
                 device: str | None = None, dtype: str | None = None):
        folder = Path(path).expanduser()
        self.path, self.__name__ = str(path), folder.name
        if not folder.is_dir() or not (folder / "config.json").is_file():
            raise RewardError(f"reward model {path!r}: not a directory with a config.json; give the directory of "
                              "a Hugging Face sequence-classification model (a reward model export)")
        if batch_size < 1 or (max_length is not None and max_length < 1):
            raise RewardError(f"reward model {path!r}: batch_size={batch_size} and max_length={max_length} must "
                              "be >= 1 (max_length null: the model's max_position_embeddings)")
        self.batch_size, self.device = batch_size, device
        self.model, self.tokenizer = _load_classifier(folder, dtype)
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        device = torch.device(self.device or (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                                              else "cpu"))
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        ids = [self._ids(p, c) for p, c in zip(prompts, completions)]
        pad = self.model.config.pad_token_id
        size = self.batch_size if pad is not None else 1
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(ids), size):
                rows = ids[start:start + size]
                width = max(len(r) for r in rows)
                batch = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
                mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
                scores += self.model(input_ids=batch, attention_mask=mask).logits[:, 0].float().tolist()
        return scores

    def _ids(self, prompt: str | list, completion: str | list) -> list[int]:
        tok = self.tokenizer
        if isinstance(prompt, list):  # messages; the completion as the assistant's turn
            turn = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            ids = tok.apply_chat_template([*prompt, *turn])
        else:
            ids = tok.encode(str(prompt) + completion_text(completion))
        bos = tok.bos_token_id
        ids = ids if bos is None or ids[:1] == [bos] else [bos, *ids]
        return ids[-self.max_length:] if self.max_length else ids


def _load_classifier(folder: Path, dtype: str | None):
    """(model, tokenizer) of a sequence-classification directory; anything but a one-label classifier whose
    weights are all in the directory's safetensors is a RewardError naming the directory."""
    from ..tokenizer import Tokenizer

    try:
        import transformers
    except ImportError:
        raise RewardError(f"reward model {str(folder)!r}: reading it needs transformers; pip install "
                          "'transformers>=4.45'") from None
    opts = {"trust_remote_code": False, "local_files_only": True}
    try:
        config = transformers.AutoConfig.from_pretrained(folder, **opts)
    except (ValueError, OSError) as err:
        raise RewardError(f"reward model {str(folder)!r}: its config.json cannot be read ({err})") from None
    kinds = list(getattr(config, "architectures", None) or [])
    if not any(k.endswith("ForSequenceClassification") for k in kinds) or config.num_labels != 1:
        raise RewardError(f"reward model {str(folder)!r} is {kinds or 'no architecture'} with num_labels="
                          f"{config.num_labels}; a reward model is a *ForSequenceClassification with one label "
                          "(export one with RewardModel.save_pretrained)")
    if not list(folder.glob("*.safetensors")):
        raise RewardError(f"reward model {str(folder)!r} has no .safetensors weights; only safetensors are read "
                          "(pickled .bin files can run code)")
    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a training log is no place for a loading bar
    try:
        model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, use_safetensors=True, output_loading_info=True, dtype=dtype or "auto", **opts)
    finally:
        if bar:
            transformers.utils.logging.enable_progress_bar()
    missing = info.get("missing_keys") or []
    if missing:
        raise RewardError(f"reward model {str(folder)!r} lacks {len(missing)} weight(s), e.g. {sorted(missing)[0]!r}: "
                          "they would be random; export the whole reward model")
    return model.eval().requires_grad_(False), Tokenizer.from_pretrained(folder)


def _is_model_path(spec: str) -> bool:
    """A reward spec that names a directory rather than an import path."""
    return "/" in spec or "\\" in spec or spec.startswith((".", "~")) or Path(spec).is_dir()


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
        fn = SequenceClassifierReward(spec) if _is_model_path(spec) else _import(spec, where)
    elif isinstance(spec, dict) and isinstance(spec.get("path"), str) and set(spec) <= {"path", "kwargs"}:
        kwargs = spec.get("kwargs") or {}
        if _is_model_path(spec["path"]):
            try:
                fn = SequenceClassifierReward(spec["path"], **kwargs)
            except TypeError as err:
                raise RewardError(f"{where}.kwargs={kwargs!r}: {err}; a reward model takes batch_size, "
                                  "max_length, device and dtype") from None
        else:
            fn = functools.partial(_import(spec["path"], f"{where}.path"), **kwargs)
    else:
        raise RewardError(f"{where}={spec!r}: give an import path or {{path: 'package.module.function', "
                          "kwargs: {…}}, or a reward model's directory")
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
    if isinstance(spec, SequenceClassifierReward):
        return spec.path
    base = spec.func if isinstance(spec, functools.partial) else spec
    return f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', type(base).__name__)}"


# -- scoring -------------------------------------------------------------------------------------------

def call_reward(name: str, fn: RewardFunc, prompts: list, completions: list, columns: dict[str, list]) -> list[float]:
    """One function's rewards as floats, NaN for None; any failure is a RewardError naming the function. An
    `async def` function is awaited (on the reward functions' event loop)."""
    values = _invoke(name, fn, prompts, completions, columns)
    if inspect.isawaitable(values):
        values = _await_all([values])[0]
        if isinstance(values, Exception):
            raise _failure(name, values, columns) from values
    return checked_rewards(name, values, len(completions))


def _invoke(name: str, fn: RewardFunc, prompts: list, completions: list, columns: dict[str, list]) -> Any:
    try:
        return fn(prompts=prompts, completions=completions, **columns)
    except Exception as err:
        raise _failure(name, err, columns) from err


def _failure(name: str, err: BaseException, columns: dict[str, list]) -> RewardError:
    return RewardError(f"reward function {name!r} raised {type(err).__name__}: {err}; it is called as "
                       f"{name}(prompts, completions, {', '.join(columns)}) with one entry per completion")


def checked_rewards(name: str, values: Any, n: int) -> list[float]:
    """`values` as n floats, NaN for None; a RewardError naming the function for anything else."""
    try:
        count = len(values)
    except TypeError:
        raise RewardError(f"reward function {name!r} returned a {type(values).__name__}; it must return a "
                          f"list of {n} floats (or None)") from None
    if count != n:
        raise RewardError(f"reward function {name!r} returned {count} rewards for {n} "
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


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _reward_loop() -> asyncio.AbstractEventLoop:
    """The event loop async reward functions run on: one for the process, in a daemon thread, so it outlives
    a rollout (clients bound to it keep working) and a notebook's own running loop does not stand in the way."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="reward-functions", daemon=True).start()
        return _loop


def _await_all(awaitables: list) -> list:
    """The results of `awaitables`, run concurrently; an exception is returned in its place, not raised."""
    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), _reward_loop()).result()


def score(funcs: Sequence[tuple[str, RewardFunc]], weights: Sequence[float], prompts: list, completions: list,
          columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-function rewards (N, F) with NaN where a function returned None, and their weighted sum (N,).

        R_i = Σ_f w_f · r_{i,f}   over the functions f whose r_{i,f} is not None

    Plain functions run in turn; the `async def` ones are started together and awaited at once.
    """
    values = [_invoke(name, fn, prompts, completions, columns) for name, fn in funcs]
    pending = [j for j, v in enumerate(values) if inspect.isawaitable(v)]
    for j, result in zip(pending, _await_all([values[j] for j in pending]) if pending else []):
        if isinstance(result, Exception):
            raise _failure(funcs[j][0], result, columns) from result
        values[j] = result
    rows = [checked_rewards(name, v, len(completions)) for (name, _), v in zip(funcs, values)]
    per_func = torch.tensor(rows, dtype=torch.float32).T.contiguous()  # (N, F)
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
