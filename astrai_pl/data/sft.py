"""SFTData: conversations, prompt/completion pairs or plain text, masked by sections, packed into bins."""

from __future__ import annotations

from functools import partial
from typing import Any

from datasets import Dataset
from torch.utils.data import DataLoader

from .base import RowsData
from .packing import check_options, collate, pack_rows
from .preflight import check_trained_tokens, describe_example
from .row_stream import RowStream
from .sampling import resumable_loader
from .sources import Encoded, announce, model_vocab_size
from .windows import windowed


class SFTData(RowsData):
    """Supervised fine-tuning rows as packed examples whose `labels` are -100 wherever the loss mask is 0.

    Prepared and checked before the first step; one encoded row is printed with its trained spans in
    [[ ]]. Train batches carry `window_tokens` (the trained targets of their accumulation window) so the
    objective's loss is the exact token mean over each window; the train loader's position travels in
    checkpoints (`sampling.StatefulLoader`), so a resumed run sees exactly the batches it would have.
    With `streaming: true` the rows are read, encoded and packed on the fly instead (`data/row_stream.py`).
    """

    kind = "sft"

    def __init__(
        self,
        *,
        max_seq_len: int = 512,
        packing: str = "bfd",
        truncation: str = "right",
        position_ids: str = "doc_reset",
        streaming: bool = False,
        val_rows: int = 64,
        shuffle_rows: int = 1024,
        **kwargs: Any,
    ):
        """
        Args:
            max_seq_len: Tokens per packed example (per row when packing is 'none').
            packing: 'none' (one row per example), 'bfd' (best-fit decreasing bins) or 'bfd_split'
                (as bfd, an overlong row split into pieces instead of truncated).
            truncation: A row longer than max_seq_len (packing none/bfd): 'right' keeps its head, 'left' its
                tail, 'drop' drops it. Counts are logged.
            position_ids: 'doc_reset' (restart at 0 per packed document), 'continuous' or 'none'.
            streaming: Read the rows of `path` (a file or a glob: jsonl, parquet, json, csv, arrow) lazily,
                encode, mask and pack them on the fly, never holding the data set in memory (needs
                trainer.max_steps); the stream's position is saved in checkpoints. See docs/data.md.
            val_rows: Streaming only: the first val_rows rows of the first file validate and never train.
            shuffle_rows: Streaming only: rows read, shuffled, encoded and packed together (0: file order).
            **kwargs: The options every post-training data module shares (path, tokenizer, sections, split,
                val_split, val_fraction, on_bad_row, batch_size, num_proc, num_workers, cache_dir, seed,
                synthetic): see `RowsData`.
        """
        check_options(max_seq_len, packing, truncation, position_ids)
        if val_rows < 0 or shuffle_rows < 0:
            raise ValueError(f"SFTData: val_rows={val_rows}, shuffle_rows={shuffle_rows}; give counts >= 0")
        super().__init__(**kwargs)
        self.stream: RowStream | None = None

    def _prepare(self) -> None:
        if not self.hparams.streaming:
            return super()._prepare()
        if self.stream is None:
            self.stream = RowStream(self.hparams, self.tokenizer, self._sections_spec, model_vocab_size(self.trainer))
            self.sections, self.val_set = self.stream.sections, self.stream.val_set

    def _build(self, splits: dict[str, Encoded]) -> None:
        hp = self.hparams
        rows = {name: self._trainable(name, encoded) for name, encoded in splits.items()}
        announce(
            f"{type(self).__name__}: a training row, trained tokens in [[ ]]:",
            describe_example(rows["train"], self.tokenizer),
        )
        for name, split in rows.items():
            packed, stats = pack_rows(split, hp.max_seq_len, hp.packing, hp.truncation, hp.position_ids)
            announce(f"{type(self).__name__} {name}: {stats.describe()}")
            reason = f"empty, or longer than max_seq_len={hp.max_seq_len} with truncation='{hp.truncation}'"
            splits[name].dropped[reason] += stats.dropped
            self._require(len(packed), f"{name} examples", splits[name])
            setattr(self, f"{name}_set", packed)

    def _trainable(self, name: str, encoded: Encoded) -> Dataset:
        """The rows that keep a trained token once they fit max_seq_len (others: error, or skipped)."""
        hp = self.hparams
        keep = check_trained_tokens(
            encoded.rows,
            hp.max_seq_len,
            hp.packing,
            hp.truncation,
            source=encoded.name,
            lines=encoded.lines,
            on_bad_row=hp.on_bad_row,
            sections=self.sections,
            dropped=encoded.dropped,
        )
        self._require(len(keep), f"{name} rows", encoded)
        return encoded.rows if len(keep) == len(encoded.rows) else encoded.rows.select(keep)

    def train_dataloader(self):
        """Shuffled examples split over the data-parallel ranks, tagged per accumulation window; the
        position (epoch, batches handed out) is saved in checkpoints, so a resumed run continues exactly."""
        hp = self.hparams
        if hp.streaming:
            return windowed(self.stream.train_loader(self.trainer), self.trainer)
        collate_fn = partial(collate, pad_id=self.tokenizer.pad_token_id)
        loader = resumable_loader(self.train_set, hp.batch_size, hp.seed, self.trainer, collate_fn,
                                  num_workers=hp.num_workers)
        return windowed(loader, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.hparams.batch_size,
            collate_fn=partial(collate, pad_id=self.tokenizer.pad_token_id),
            num_workers=self.hparams.num_workers,
        )

    test_dataloader = val_dataloader
