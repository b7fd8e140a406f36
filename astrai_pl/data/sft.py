"""SFTData: conversations, prompt/completion pairs or plain text, masked by sections, packed into bins."""

from __future__ import annotations

from functools import partial

from datasets import Dataset
from torch.utils.data import DataLoader

from .base import RowsData
from .packing import check_options, collate, pack_rows
from .preflight import check_trained_tokens, describe_example
from .preprocess import Section
from .sampling import StatefulLoader, data_parallel_rank, shuffled_batches
from .sources import Arithmetic, Encoded, announce
from .windows import windowed


class SFTData(RowsData):
    """Supervised fine-tuning rows as packed examples whose `labels` are -100 wherever the loss mask is 0.

    Prepared and checked before the first step; one encoded row is printed with its trained spans in
    [[ ]]. Train batches carry `window_tokens` (the trained targets of their accumulation window) so the
    objective's loss is the exact token mean over each window; the train loader's position travels in
    checkpoints (`sampling.StatefulLoader`), so a resumed run sees exactly the batches it would have.
    """

    kind = "sft"

    def __init__(
        self,
        path: str | None = None,
        tokenizer: str = "byte",
        sections: str | list[Section] | None = None,
        split: str = "train",
        val_split: str | None = None,
        val_fraction: float = 0.05,
        max_seq_len: int = 512,
        packing: str = "bfd",
        truncation: str = "right",
        position_ids: str = "doc_reset",
        on_bad_row: str = "error",
        batch_size: int = 8,
        num_proc: int | None = None,
        num_workers: int = 0,
        cache_dir: str | None = None,
        seed: int = 0,
        synthetic: Arithmetic | None = None,
    ):
        """
        Args:
            path: Rows: a jsonl/json/parquet/txt file, a saved `datasets` directory or a hub name; None = the
                built-in arithmetic task (`synthetic`).
            tokenizer: 'byte' (built in) or a Hugging Face tokenizer directory.
            sections: How a row becomes tokens and a loss mask: a preset name (messages, chat, text,
                prompt_completion) or a list of Sections; None = the preset matching the rows' fields.
            split: Split of a hub dataset or saved DatasetDict to train on.
            val_split: Split to validate on; None = hold out `val_fraction` of the rows instead.
            val_fraction: Share of rows held out for validation (by a seeded hash of the row index).
            max_seq_len: Tokens per packed example (per row when packing is 'none').
            packing: 'none' (one row per example), 'bfd' (best-fit decreasing bins) or 'bfd_split'
                (as bfd, an overlong row split into pieces instead of truncated).
            truncation: A row longer than max_seq_len (packing none/bfd): 'right' keeps its head, 'left' its
                tail, 'drop' drops it. Counts are logged.
            position_ids: 'doc_reset' (restart at 0 per packed document), 'continuous' or 'none'.
            on_bad_row: 'error' (stop, naming the file, line and field) or 'skip' (drop the row, counted in the log).
            batch_size: Examples per micro-batch.
            num_proc: Processes for encoding (`Dataset.map`).
            num_workers: DataLoader worker processes.
            cache_dir: Where datasets are cached (default ~/.cache/astrai_pl or $ASTRAI_CACHE).
            seed: Seed of the held-out split, the synthetic rows and the shuffle.
            synthetic: The arithmetic task used when path is None.
        """
        check_options(max_seq_len, packing, truncation, position_ids)
        super().__init__(
            path,
            tokenizer,
            sections,
            split,
            val_split,
            val_fraction,
            on_bad_row,
            batch_size,
            num_proc,
            num_workers,
            cache_dir,
            seed,
            synthetic,
        )

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
        rank, replicas = data_parallel_rank(self.trainer)
        plan = partial(
            shuffled_batches,
            len(self.train_set),
            hp.batch_size,
            seed=hp.seed,
            drop_last=False,
            rank=rank,
            world_size=replicas,
        )
        loader = StatefulLoader(
            self.train_set,
            plan,
            partial(collate, pad_id=self.tokenizer.pad_token_id),
            num_workers=hp.num_workers,
        )
        return windowed(loader, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.hparams.batch_size,
            collate_fn=partial(collate, pad_id=self.tokenizer.pad_token_id),
            num_workers=self.hparams.num_workers,
        )

    test_dataloader = val_dataloader
