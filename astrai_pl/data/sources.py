"""Where post-training rows come from, and the preparation SFTData, DPOData and GRPOData share.

`encode_splits` reads rows (a file, a saved `datasets` directory, a hub dataset, or the built-in
arithmetic task when `path` is None), checks the tokenizer against the sections and the model before
anything is encoded (`preflight.check_tokenizer`), encodes every row with `Dataset.map` (cached by
fingerprint), and splits off the held-out rows. Every bad row raises `DataError` with its file and line;
under on_bad_row='skip' it is dropped and counted by reason in its split's `Encoded.dropped`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from lightning.pytorch.utilities import rank_zero_info

from ..hub import resolve_dataset
from ..model.config import ConfigError
from .corpus import is_held_out
from .files import FILE_LOADERS, load_file
from .formats import infer_sections, row_format
from .preflight import check_bos_once, check_model_fit, check_tokenizer
from .preprocess import Section, preset_sections
from .rows import DataError, Dropped, read_jsonl
from .synthetic import OPERATORS, Problem, check_train_range, held_out_set, problems, synthetic_dataset
from .tokenized import load_jsonl, tokenize_dataset


@dataclass(frozen=True)
class Arithmetic:
    """The built-in synthetic task, used when `path` is None: "What is 37 + 48?" -> "85"."""

    train_rows: int = 20_000
    """Training rows (problems may repeat)."""
    test_rows: int = 200
    """Held-out rows: problems that never occur in training."""
    ops: tuple[str, ...] = ("+", "-")
    """Operators drawn from: any of +, -, *."""
    max_operand: int = 99
    """Operands are drawn from [0, max_operand]."""
    held_out_fraction: float = 0.1
    """Share of all possible problems reserved for the held-out split."""
    train_range: tuple[float, float] = (0.0, 1.0)
    """The part of the training problems used, [low, high) of a fixed hash of each problem: stages given
    ranges that do not overlap ([0, 0.5] and [0.5, 1]) train on different problems. The held-out split is
    the same whatever the range."""

    def __post_init__(self) -> None:
        if self.train_rows < 1 or self.test_rows < 1:
            raise ConfigError(
                f"Arithmetic(train_rows={self.train_rows}, test_rows={self.test_rows}): both must be >= 1"
            )
        bad = [op for op in self.ops if op not in OPERATORS]
        if bad or not self.ops:
            raise ConfigError(
                f"Arithmetic.ops={list(self.ops)}: use a non-empty subset of {sorted(OPERATORS)}"
            )
        if self.max_operand < 1:
            raise ConfigError(f"Arithmetic.max_operand={self.max_operand}: must be >= 1")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ConfigError(f"Arithmetic.held_out_fraction={self.held_out_fraction}: must lie in (0, 1)")
        try:
            check_train_range(self.train_range)
        except ValueError as e:
            raise ConfigError(f"Arithmetic.{e}") from None

    def options(self) -> dict[str, Any]:
        return {"ops": self.ops, "max_operand": self.max_operand, "held_out_fraction": self.held_out_fraction,
                "train_range": tuple(self.train_range)}

    def problems(self, split: str, seed: int = 0, n: int | None = None) -> list[Problem]:
        """The problems behind the rows of `split` ("train" or "test"); `n` defaults to that split's rows."""
        n = (self.train_rows if split == "train" else self.test_rows) if n is None else n
        return problems(n, split, seed, **self.options())

    def held_out_set(self) -> list[Problem]:
        """Every held-out problem of these options, each once (`synthetic.held_out_set`)."""
        return held_out_set(self.ops, self.max_operand, self.held_out_fraction)

    def dataset(self, kind: str, split: str, seed: int, cache_dir: str | None) -> Dataset:
        n = self.train_rows if split == "train" else self.test_rows
        return synthetic_dataset(kind, n, split, seed, cache_dir=cache_dir, **self.options())


def plain(value: Any) -> Any:
    """Sections / Arithmetic as plain dicts and lists, so checkpoints load with weights_only=True."""
    if dataclasses.is_dataclass(value):
        return {k: plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


# --- reading -------------------------------------------------------------------------------------


class Rows(NamedTuple):
    dataset: Dataset
    """The raw rows."""
    lines: list[int] | None
    """1-based line of each row in a JSONL file; None: rows are numbered (1-based) instead."""
    name: str
    """What errors call the source: the file, the directory or the hub name."""


def _first_row(path: str, split: str, on_bad_row: str, cache_dir: str | None) -> dict[str, Any]:
    if Path(path).suffix == ".jsonl" and Path(path).is_file():
        return read_jsonl(path, None, on_bad_row).rows[0]
    return read_rows(path, split, [], on_bad_row, cache_dir).dataset[0]


def resolve_sections(
    spec: str | Sequence[Section | dict] | None,
    kind: str,
    path: str | None,
    split: str = "train",
    on_bad_row: str = "error",
    cache_dir: str | None = None,
) -> list[Section]:
    """A preset name, an explicit list, or (None) the preset matching the rows' fields."""
    if isinstance(spec, str):
        return preset_sections(spec)
    if spec is not None:
        sections = [s if isinstance(s, Section) else Section(**s) for s in spec]
        if not sections:
            raise ConfigError("sections=[]: list at least one Section, or give a preset name")
        return sections
    if path is None:
        return preset_sections(row_format(kind).default_preset)
    return infer_sections(_first_row(path, split, on_bad_row, cache_dir), kind)


def read_rows(
    path: str,
    split: str,
    sections: Sequence[Section],
    on_bad_row: str,
    cache_dir: str | None,
    dropped: Dropped | None = None,
) -> Rows:
    """A local jsonl/json/parquet/txt file, a directory saved by `datasets`, or a hub dataset's `split`.

    JSONL lines are parsed and checked against `sections` here, so a bad line is named by its number;
    lines that are not UTF-8 are named (or skipped, counted into `dropped`) in every text file.
    """
    p = Path(path)
    if p.suffix in FILE_LOADERS and not p.is_file():
        raise DataError(
            "no such file", fix="pass an existing file, a saved dataset directory or a hub name", source=path
        )
    if p.suffix == ".jsonl":
        dataset, lines = load_jsonl(p, sections, on_bad_row=on_bad_row, cache_dir=cache_dir, dropped=dropped)
        return Rows(dataset, lines, path)
    if p.is_dir():
        dataset = load_from_disk(str(p))
    elif p.suffix in FILE_LOADERS:
        dataset = load_file(p, cache_dir, on_bad_row, dropped)
    else:  # a hub id (owner/name[@revision]) is read from its snapshot's data files in the hub cache
        dataset = load_dataset(resolve_dataset(path), cache_dir=cache_dir)
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise DataError(
                f"no split {split!r} (splits: {sorted(dataset)})",
                "split",
                f"set split (or val_split) to one of {sorted(dataset)}",
                source=path,
            )
        dataset = dataset[split]
    return Rows(dataset, None, path)


# --- encoding and splitting ----------------------------------------------------------------------


class Encoded(NamedTuple):
    rows: Dataset
    """Encoded rows (columns of the kind: see `tokenize_dataset`)."""
    lines: list[int] | None
    """Each row's line in the source file (None: row numbers)."""
    name: str
    dropped: Dropped
    """Rows of the source dropped so far (before a held-out split: those of both splits), by reason."""


def encode_splits(
    kind: str,
    tokenizer: Any,
    sections: Sequence[Section],
    *,
    path: str | None,
    split: str,
    val_split: str | None,
    val_fraction: float,
    synthetic: Arithmetic,
    seed: int,
    on_bad_row: str,
    num_proc: int | None,
    cache_dir: str | None,
    vocab_size: int | None = None,
) -> dict[str, Encoded]:
    """{"train": …, "val": …}: rows read, preflighted and encoded; held-out rows split off."""
    ids_column = row_format(kind).ids_column
    check_model_fit(tokenizer, vocab_size)
    check_tokenizer(tokenizer, sections, vocab_size)
    encoded = {}
    for name, (rows, lines, source, dropped) in _read_sources(
        kind, sections, path, split, val_split, synthetic, seed, on_bad_row, cache_dir
    ).items():
        out = tokenize_dataset(
            rows,
            sections,
            tokenizer,
            kind=kind,
            source=source,
            lines=lines,
            on_bad_row=on_bad_row,
            num_proc=num_proc,
            dropped=dropped,
        )
        if on_bad_row == "skip" and len(out) != len(rows):
            lines = None  # rows were dropped: positions no longer match lines
        check_bos_once(out, tokenizer, source, lines, ids_column)
        encoded[name] = Encoded(out, lines, source, dropped)
    if "all" in encoded:
        encoded = hold_out(encoded["all"], val_fraction, seed)
    return encoded


def _read_sources(
    kind: str,
    sections: Sequence[Section],
    path: str | None,
    split: str,
    val_split: str | None,
    synthetic: Arithmetic,
    seed: int,
    on_bad_row: str,
    cache_dir: str | None,
) -> dict[str, tuple[Dataset, list[int] | None, str, Dropped]]:
    """{"train", "val"} (or {"all"}, to be split): each source's rows, lines, name and what it dropped."""
    if path is None:
        splits = {"train": "train", "val": "test"}
        return {
            s: (synthetic.dataset(kind, name, seed, cache_dir), None, f"synthetic arithmetic ({name})", Dropped())
            for s, name in splits.items()
        }
    splits = {"all": split} if val_split is None else {"train": split, "val": val_split}
    out = {}
    for s, name in splits.items():
        dropped = Dropped()
        out[s] = (*read_rows(path, name, sections, on_bad_row, cache_dir, dropped), dropped)
    return out


def hold_out(encoded: Encoded, fraction: float, seed: int) -> dict[str, Encoded]:
    """Train / val subsets, a row held out when the hash of (seed, row index) falls below `fraction`."""
    held = [is_held_out(str(i), fraction, seed) for i in range(len(encoded.rows))]
    out = {}
    for name, keep in (("train", False), ("val", True)):
        index = [i for i, h in enumerate(held) if h == keep]
        if not index:
            raise DataError(
                f"val_fraction={fraction} leaves no {name} rows out of {len(held)}",
                "val_fraction",
                "change val_fraction, or give a val_split",
                source=encoded.name,
            )
        lines = None if encoded.lines is None else [encoded.lines[i] for i in index]
        out[name] = Encoded(encoded.rows.select(index), lines, encoded.name, Dropped(encoded.dropped))
    return out


# --- loaders -------------------------------------------------------------------------------------


def model_vocab_size(trainer: Any) -> int | None:
    """The vocab_size of the objective the trainer is fitting, when there is one."""
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    arch = getattr(module, "arch", None)
    return getattr(arch, "vocab_size", None)


REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")


def reward_fields(trainer: Any) -> dict[str, str]:
    """Row fields the reward functions of the trainer's objective require -> the first function that does:
    each parameter without a default other than the prompts, completions and completion ids."""
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    fields: dict[str, str] = {}
    for name, fn in getattr(module, "reward_funcs", None) or ():
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a callable without a signature: nothing to check
            continue
        for p in parameters:
            required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            if required and p.name not in REWARD_ARGUMENTS:
                fields.setdefault(p.name, name)
    return fields


def announce(title: str, text: str = "") -> None:
    """Print (rank zero, through Lightning's logger) what a run is about to train on."""
    rank_zero_info(f"{title}\n{text}" if text else title)
