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

from ..tokenizer import load_tokenizer
from .preprocess import Section
from .pretrain import default_cache_dir
from .rows import check_policy, require_rows
from .sources import Arithmetic, Encoded, encode_splits, model_vocab_size, plain, resolve_sections


class RowsData(L.LightningDataModule):
    """Rows of one kind (`kind`: sft, dpo or grpo), encoded once and checked before training starts."""

    kind = "sft"

    def __init__(
        self,
        path: str | None = None,
        tokenizer: str = "byte",
        sections: str | list[Section] | None = None,
        split: str = "train",
        val_split: str | None = None,
        val_fraction: float = 0.05,
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
            path: Rows in the module's format (SFTData: messages, prompt/completion or text; DPOData:
                prompt/chosen/rejected; GRPOData: a prompt and the columns rewards read; KTOData:
                prompt/completion/label): a jsonl/json/parquet/txt file, a saved `datasets` directory or a hub id
                (owner/name[@revision]: its data files, no loading script; see docs/data.md);
                None = the built-in arithmetic task (`synthetic`).
            tokenizer: 'byte' (built in), a Hugging Face tokenizer directory, or a hub id (its tokenizer files).
            sections: How a row becomes tokens and a loss mask: a preset name (SFTData: messages, chat, text,
                prompt_completion; DPOData: preference, preference_text, with one Section on 'chosen' and one on
                'rejected'; GRPOData: grpo, the prompt through the chat template ending
                with the assistant header; KTOData: chat, prompt_completion) or a list of Sections; None = the
                preset matching the rows' fields.
            split: Split of a hub dataset or saved DatasetDict to train on.
            val_split: Split to validate on; None = hold out `val_fraction` of the rows instead.
            val_fraction: Share of rows held out for validation (by a seeded hash of the row index).
            on_bad_row: 'error' (stop, naming the file, line and field) or 'skip' (drop the row, counted in the log).
            batch_size: Examples (SFTData, KTOData), pairs (DPOData) or prompts (GRPOData) per micro-batch.
            num_proc: Processes for encoding (`Dataset.map`).
            num_workers: DataLoader worker processes.
            cache_dir: Where datasets are cached (default ~/.cache/astrai_pl or $ASTRAI_CACHE).
            seed: Seed of the held-out split, the synthetic rows and the shuffle.
            synthetic: The arithmetic task used when path is None.
        """
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
