"""GRPOData: prompts for a policy to continue, with the columns the reward functions read (e.g. `answer`)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
from datasets import Dataset
from torch.utils.data import DataLoader

from .base import RowsData
from .packing import row_lengths
from .rows import DataError, log_skipped
from .sampling import StatefulLoader, resumable_loader
from .sources import Encoded, announce, reward_fields

PROMPT_TRUNCATIONS = ("left", "drop")


def collate_prompts(rows: Sequence[dict[str, Any]], tokenizer: Any) -> dict[str, list]:
    """`prompt_ids` (lists of ids, unpadded: the engine batches them), `prompt_text` (the same ids decoded,
    template markup included) and every other column of the rows as a list (e.g. `answer`)."""
    batch: dict[str, list] = {key: [r[key] for r in rows] for key in rows[0]}
    batch["prompt_text"] = [tokenizer.decode(ids) for ids in batch["prompt_ids"]]
    return batch


def _cut_left(batch: dict[str, list], max_len: int) -> dict[str, list]:
    return {"prompt_ids": [ids[-max_len:] for ids in batch["prompt_ids"]]}


class GRPOData(RowsData):
    """Prompts for GRPO rollouts: rows `prompt` (text or messages) plus any columns rewards read.

    A batch is a dict of lists: `prompt_ids`, `prompt_text` and the rows' own columns (`answer`, …).
    When the trainer fits an objective with reward functions, every row must hold each field they
    require (a parameter without a default, such as `answer`): a row without one is an error naming
    its file, line and field before step 1 (or, with on_bad_row='skip', dropped and counted).
    """

    kind = "grpo"

    def __init__(self, *, max_prompt_len: int = 256, truncation: str = "left", **kwargs: Any):
        """
        Args:
            max_prompt_len: Longest prompt in tokens.
            truncation: A longer prompt: 'left' keeps its tail (the question and the assistant header), 'drop'
                drops the row. Counts are logged.
            **kwargs: The options every post-training data module shares (path, tokenizer, sections, split,
                val_split, val_fraction, on_bad_row, batch_size, num_proc, num_workers, cache_dir, seed,
                synthetic): see `RowsData`.
        """
        if truncation not in PROMPT_TRUNCATIONS:
            raise ValueError(
                f"GRPOData.truncation={truncation!r}; use one of {PROMPT_TRUNCATIONS} (the end of "
                "a prompt holds the assistant header the policy continues from)"
            )
        if max_prompt_len < 1:
            raise ValueError(f"GRPOData.max_prompt_len={max_prompt_len}; must be >= 1")
        super().__init__(**kwargs)

    def _build(self, splits: dict[str, Encoded]) -> None:
        self.train_set, self.val_set = (self._fit(name, splits[name]) for name in ("train", "val"))
        first = self.train_set[0]
        extra = {k: v for k, v in first.items() if k not in ("prompt_ids", "prompt")}
        announce(
            "GRPOData: a training prompt (the policy continues after it) and its columns:",
            f"{self.tokenizer.decode(first['prompt_ids'])}\n{extra}",
        )

    def _fit(self, name: str, encoded: Encoded) -> Dataset:
        """Prompts with the fields the rewards read, cut to max_prompt_len from the left or dropped ('drop')."""
        limit, rows = self.hparams.max_prompt_len, self._with_reward_fields(encoded)
        long = np.flatnonzero(row_lengths(rows, "prompt_ids") > limit)
        if len(long):
            what = "dropped" if self.hparams.truncation == "drop" else "cut from the left"
            announce(f"GRPOData {encoded.name}: {len(long)} prompt(s) longer than max_prompt_len={limit} {what}")
        if len(long) and self.hparams.truncation == "drop":
            encoded.dropped[f"longer than max_prompt_len={limit} (truncation='drop')"] += len(long)
            rows = rows.select(np.setdiff1d(np.arange(len(rows)), long))
        elif len(long):
            rows = rows.map(_cut_left, batched=True, fn_kwargs={"max_len": limit}, desc="cutting long prompts")
        self._require(len(rows), f"{name} prompts", encoded)
        return rows

    def _with_reward_fields(self, encoded: Encoded) -> Dataset:
        """The rows that hold every field the reward functions require (others: error, or skipped)."""
        rows, missing = encoded.rows, {}
        for field, func in reward_fields(self.trainer).items():
            values = rows[field] if field in rows.column_names else [None] * len(rows)
            lacking = [i for i, v in enumerate(values) if v is None]
            for i in lacking:
                missing.setdefault(i, DataError(
                    f"missing field (reward function {func} reads it; {len(lacking)} row(s) lack it)", field,
                    f"give every row '{field}', drop {func} from model.init_args.reward_funcs, or pass "
                    "on_bad_row='skip'").at_row(encoded.name, encoded.lines, i))
        if missing and self.hparams.on_bad_row == "error":
            raise missing[min(missing)]
        log_skipped([missing[i] for i in sorted(missing)], encoded.name, encoded.dropped)
        return rows.select(np.setdiff1d(np.arange(len(rows)), list(missing))) if missing else rows

    def _loader(self, dataset: Dataset) -> DataLoader:
        return DataLoader(
            dataset.with_format(None),
            batch_size=self.hparams.batch_size,
            collate_fn=partial(collate_prompts, tokenizer=self.tokenizer),
            num_workers=self.hparams.num_workers,
        )

    def train_dataloader(self) -> StatefulLoader:
        """Shuffled prompts split over the data-parallel ranks; the position is saved in checkpoints, so a
        resumed run rolls out the prompts the interrupted one would have."""
        hp = self.hparams
        return resumable_loader(self.train_set.with_format(None), hp.batch_size, hp.seed, self.trainer,
                                partial(collate_prompts, tokenizer=self.tokenizer), num_workers=hp.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    test_dataloader = val_dataloader
