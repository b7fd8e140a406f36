"""DPOData: preference pairs — a shared prompt, a chosen and a rejected response — padded per batch."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from .base import RowsData
from .packing import IGNORE_INDEX, column_of, ragged, row_lengths
from .preflight import check_trained_tokens, describe_example
from .rows import DataError, log_skipped
from .sampling import resumable_loader
from .sources import Encoded, announce
from .windows import chosen_tokens_in, pairs_in, windowed

SIDES = ("chosen", "rejected")
DPO_TRUNCATIONS = ("right", "drop")


def check_length_options(owner: str, max_seq_len: int, truncation: str, why_not_left: str) -> None:
    """Refuse a truncation that would cut the prompt (`why_not_left` says why) and a max_seq_len with no room
    for one target token, naming `owner`'s field."""
    if truncation not in DPO_TRUNCATIONS:
        raise ValueError(f"{owner}.truncation={truncation!r}; use one of {DPO_TRUNCATIONS} ({why_not_left})")
    if max_seq_len < 2:
        raise ValueError(f"{owner}.max_seq_len={max_seq_len}; need at least 2 tokens for one target")


def _labels(ids: Sequence[int], mask: Sequence[int]) -> list[int]:
    # the first token is never a target (nothing precedes it), as in packed SFT examples
    return [IGNORE_INDEX] + [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]


def identical_pairs(rows: Any, max_seq_len: int) -> np.ndarray:
    """Indices of the pairs whose chosen and rejected sequences are the same once cut to max_seq_len.

    Such a pair teaches nothing: its log-ratio margin is 0 for every policy, so it only dilutes the batch.
    """
    (chosen, c_off), (rejected, r_off) = (ragged(column_of(rows, f"{side}_input_ids")) for side in SIDES)
    c_len, r_len = (np.minimum(np.diff(off), max_seq_len) for off in (c_off, r_off))
    same = [i for i in np.flatnonzero(c_len == r_len)
            if np.array_equal(chosen[c_off[i]:c_off[i] + c_len[i]], rejected[r_off[i]:r_off[i] + c_len[i]])]
    return np.asarray(same, dtype=np.int64)


def collate_pairs(rows: Sequence[dict[str, Any]], pad_id: int, max_seq_len: int) -> dict[str, torch.Tensor]:
    """Chosen and rejected sequences, cut to max_seq_len and right-padded to one width T.

    Returns `{side}_input_ids` and `{side}_labels` (B, T) for side in chosen/rejected — labels are the
    tokens where the loss mask is 1 and -100 elsewhere (prompt, padding) — `prompt_lengths` (B,): the
    tokens of the prompt both responses share, `margin` (B,) when the rows have one, and `row_index` (B,): each pair's position in its split,
    when the rows carry it (DPOData's do), which keys precomputed reference log-probabilities. With one
    width the objective can stack both sides into a single (2B, T) forward.
    """
    cut = {side: [r[f"{side}_input_ids"][:max_seq_len] for r in rows] for side in SIDES}
    width = max(len(ids) for side in SIDES for ids in cut[side])
    batch: dict[str, torch.Tensor] = {}
    for side in SIDES:
        masks = [r[f"{side}_loss_mask"][:max_seq_len] for r in rows]
        batch[f"{side}_input_ids"] = torch.tensor(
            [ids + [pad_id] * (width - len(ids)) for ids in cut[side]], dtype=torch.long)
        batch[f"{side}_labels"] = torch.tensor(
            [_labels(ids, m) + [IGNORE_INDEX] * (width - len(ids)) for ids, m in zip(cut[side], masks)],
            dtype=torch.long)
    batch["prompt_lengths"] = torch.tensor([min(r["prompt_length"], max_seq_len) for r in rows], dtype=torch.long)
    if "margin" in rows[0]:  # TRL's per-pair margin, for the reward model
        batch["margin"] = torch.tensor([float(r["margin"]) for r in rows], dtype=torch.float32)
    if "row_index" in rows[0]:
        batch["row_index"] = torch.tensor([r["row_index"] for r in rows], dtype=torch.long)
    return batch


class DPOData(RowsData):
    """Preference pairs for DPO: rows `prompt`, `chosen`, `rejected` (text or messages).

    Train batches carry `window_pairs` (the pairs of their accumulation window) and `window_chosen_tokens` (the
    scored tokens of its chosen responses), with which an objective can make a per-pair mean and a chosen-token
    mean (DPO's rpo_alpha and 'sft' terms, ORPO's NLL) exact under gradient accumulation, and every batch carries `row_index` (the
    pair's position in its split). A pair whose chosen equals its rejected is an error before training
    starts (or, with on_bad_row='skip', dropped and counted).
    """

    kind = "dpo"

    def __init__(self, *, max_seq_len: int = 512, truncation: str = "right", **kwargs: Any):
        """
        Args:
            max_seq_len: Longest prompt + response; longer sequences are cut or their pair dropped.
            truncation: 'right' (cut the response's tail) or 'drop' (drop the pair). Counts are logged.
            **kwargs: The options every post-training data module shares (path, tokenizer, sections, split,
                val_split, val_fraction, on_bad_row, batch_size, num_proc, num_workers, cache_dir, seed,
                synthetic): see `RowsData`.
        """
        check_length_options("DPOData", max_seq_len, truncation,
                             "cutting a pair's left side would change the prompt the two responses share")
        super().__init__(**kwargs)

    def _build(self, splits: dict[str, Encoded]) -> None:
        self.train_set, self.val_set = (self._trainable(name, splits[name]) for name in ("train", "val"))
        for side in SIDES:
            announce(f"DPOData: a training pair, {side} (trained tokens in [[ ]]):",
                     describe_example(self.train_set, self.tokenizer, 0, f"{side}_input_ids", f"{side}_loss_mask"))

    def _trainable(self, name: str, encoded: Encoded) -> Dataset:
        """Pairs whose two responses each keep a trained token within max_seq_len (and fit it, for 'drop')."""
        hp = self.hparams
        keep = None
        for side in SIDES:
            kept = check_trained_tokens(encoded.rows, hp.max_seq_len, "none", hp.truncation, source=encoded.name,
                                        lines=encoded.lines, on_bad_row=hp.on_bad_row, mask_column=f"{side}_loss_mask",
                                        dropped=encoded.dropped)
            keep = kept if keep is None else np.intersect1d(keep, kept)
        if hp.truncation == "drop":
            longest = np.maximum(*(row_lengths(encoded.rows, f"{side}_input_ids") for side in SIDES))
            dropped = int((longest > hp.max_seq_len).sum())
            announce(f"DPOData {encoded.name}: {dropped} pair(s) longer than max_seq_len={hp.max_seq_len} dropped")
            encoded.dropped[f"longer than max_seq_len={hp.max_seq_len} (truncation='drop')"] += dropped
            keep = np.intersect1d(keep, np.flatnonzero(longest <= hp.max_seq_len))
        keep = np.setdiff1d(keep, self._identical(encoded, keep))
        self._require(len(keep), f"{name} pairs", encoded)
        rows = encoded.rows if len(keep) == len(encoded.rows) else encoded.rows.select(keep)
        return rows.add_column("row_index", np.arange(len(rows)))

    def _identical(self, encoded: Encoded, keep: np.ndarray) -> np.ndarray:
        """Pairs of `keep` whose chosen equals their rejected: a DataError, or (on_bad_row='skip') dropped and
        counted."""
        same = np.intersect1d(identical_pairs(encoded.rows, self.hparams.max_seq_len), keep)
        if len(same) and self.hparams.on_bad_row == "error":
            raise DataError(
                f"chosen and rejected are the same once cut to max_seq_len={self.hparams.max_seq_len} "
                f"({len(same)} pair(s) like this); such a pair has no preference to learn",
                "rejected", "fix or remove the pair, raise max_seq_len if they differ only past it, "
                "or pass on_bad_row='skip'").at_row(encoded.name, encoded.lines, int(same[0]))
        log_skipped([f"row {i + 1}: chosen equals rejected" for i in same], encoded.name, encoded.dropped,
                    ["chosen equals rejected"] * len(same))
        return same

    def _collate(self):
        return partial(collate_pairs, pad_id=self.tokenizer.pad_token_id, max_seq_len=self.hparams.max_seq_len)

    def _loader(self, dataset: Dataset) -> DataLoader:
        return DataLoader(dataset.with_format(None), batch_size=self.hparams.batch_size, collate_fn=self._collate(),
                          num_workers=self.hparams.num_workers)

    def train_dataloader(self):
        """Shuffled pairs split over the data-parallel ranks, tagged per accumulation window; the position is
        saved in checkpoints (`sampling.StatefulLoader`), so a resumed run continues with the next batch."""
        hp = self.hparams
        loader = resumable_loader(self.train_set.with_format(None), hp.batch_size, hp.seed, self.trainer,
                                  self._collate(), num_workers=hp.num_workers)
        return windowed(loader, self.trainer, pairs_in, "window_pairs", also={"window_chosen_tokens": chosen_tokens_in})

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def indexed_loaders(self) -> dict[str, DataLoader]:
        """Every pair of each split ("train", "val") once, in row order and on every rank: what a table
        keyed by `row_index` is filled from (DPO's precompute_ref_log_probs). The test loader is "val"."""
        self._prepare()
        return {"train": self._loader(self.train_set), "val": self._loader(self.val_set)}

    test_dataloader = val_dataloader
