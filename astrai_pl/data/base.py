"""RowsData: the one base of the post-training data modules (SFTData, DPOData, GRPOData).

It holds what the three share — where rows come from, the tokenizer, the sections, the held-out split,
the bad-row policy — and prepares everything in `prepare_data` / `setup`, so that any failure (a bad
row, a template that does not render, an untrained end-of-turn token, a row left without a trained
token) stops the run before step 1 with the reason. A subclass turns the encoded splits into datasets
(`_build`) and defines its loaders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L

from .preprocess import Section
from .pretrain import default_cache_dir, load_tokenizer
from .rows import check_policy, require_rows
from .sources import Arithmetic, Encoded, encode_splits, model_vocab_size, plain, resolve_sections


class RowsData(L.LightningDataModule):
    """Rows of one kind (`kind`: sft, dpo or grpo), encoded once and checked before training starts."""

    kind = "sft"

    def __init__(
        self,
        path: str | None,
        tokenizer: str,
        sections: str | list[Section] | None,
        split: str,
        val_split: str | None,
        val_fraction: float,
        on_bad_row: str,
        batch_size: int,
        num_proc: int | None,
        num_workers: int,
        cache_dir: str | None,
        seed: int,
        synthetic: Arithmetic | None,
    ):
        super().__init__()
        name = type(self).__name__
        check_policy(on_bad_row)
        if val_split is None and not 0.0 < val_fraction < 1.0:
            raise ValueError(f"{name}.val_fraction={val_fraction}: must lie in (0, 1), or give a val_split")
        if batch_size < 1:
            raise ValueError(f"{name}.batch_size={batch_size}: must be >= 1")
        # collects the subclass's arguments too; sections and the task are stored as plain values so that
        # checkpoints (which carry these) load with weights_only=True
        self.save_hyperparameters(ignore=["sections", "synthetic"])
        self.synthetic = synthetic or Arithmetic()
        self.hparams.update(sections=plain(sections), synthetic=plain(self.synthetic))
        self.tokenizer = load_tokenizer(tokenizer)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self._sections_spec = sections
        self.sections: list[Section] | None = None
        self.train_set: Any = None
        self.val_set: Any = None

    def prepare_data(self) -> None:
        self._prepare()

    def setup(self, stage: str | None = None) -> None:
        self._prepare()

    def _prepare(self) -> None:
        if self.train_set is None:
            self._build(self._encoded())

    def _encoded(self) -> dict[str, Encoded]:
        hp = self.hparams
        cache = str(self.cache_dir / "datasets")
        self.sections = resolve_sections(
            self._sections_spec, self.kind, hp.path, hp.split, hp.on_bad_row, cache
        )
        return encode_splits(
            self.kind,
            self.tokenizer,
            self.sections,
            path=hp.path,
            split=hp.split,
            val_split=hp.val_split,
            val_fraction=hp.val_fraction,
            synthetic=self.synthetic,
            seed=hp.seed,
            on_bad_row=hp.on_bad_row,
            num_proc=hp.num_proc,
            cache_dir=cache,
            vocab_size=model_vocab_size(self.trainer),
        )

    def _build(self, splits: dict[str, Encoded]) -> None:
        """Set `train_set` and `val_set` from the encoded, checked splits."""
        raise NotImplementedError

    def _require(self, count: int, what: str, encoded: Encoded) -> None:
        """Stop before training when a split is left with nothing (`what`: e.g. "train rows"), saying
        how many rows were dropped for what."""
        require_rows(count, what, encoded.name, encoded.dropped)

    def held_out_problems(self, n: int | None = None):
        """The arithmetic problems of the held-out rows (path None), for generation-based evaluation."""
        return self.synthetic.problems("test", self.hparams.seed, n)
