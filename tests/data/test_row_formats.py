"""A row format is one `RowFormat` and one entry in `ROW_FORMATS`; every step that depends on the format
looks it up there."""

import pytest
from datasets import Dataset

from astrai_pl.data import DPOData, GRPOData, KTOData, RowsData, SFTData
from astrai_pl.data.conversations import conversation_segments
from astrai_pl.data.formats import ROW_FORMATS, encode_rows, infer_sections, row_format
from astrai_pl.data.preprocess import RowFormat, Section
from astrai_pl.data.sources import resolve_sections
from astrai_pl.data.synthetic import generate_rows
from astrai_pl.data.tokenized import tokenize_dataset
from astrai_pl.tokenizer import Tokenizer


def unpaired_columns(segments, sections):
    ((ids, mask),) = segments
    return {"input_ids": ids, "loss_mask": mask}


def unpaired_row(question, answer, near_miss):
    return {"prompt": question, "completion": answer, "label": True}


UNPAIRED = RowFormat(
    kind="rated",
    segments=conversation_segments,
    columns=unpaired_columns,
    count=1,
    ids_column="input_ids",
    default_preset="prompt_completion",
    sections_of=lambda row: [Section("prompt", action="mask"), Section("completion", eos=True)],
    arithmetic_row=unpaired_row,
    keeps_columns=True,
)


def test_a_new_format_is_one_registry_entry(monkeypatch):
    monkeypatch.setitem(ROW_FORMATS, "rated", UNPAIRED)
    tok = Tokenizer.byte_level()
    rows = list(generate_rows("rated", 3, seed=1))
    assert all(set(r) == {"prompt", "completion", "label"} for r in rows)
    sections = infer_sections(rows[0], "rated")
    assert resolve_sections(None, "rated", None)[1].eos
    encoded = tokenize_dataset(Dataset.from_list(rows), sections, tok, kind="rated")
    # the row's own columns are kept (keeps_columns), the encoded ones added
    assert {"label", "input_ids", "loss_mask"} <= set(encoded.column_names)
    first = encoded[0]
    assert first["input_ids"][-1] == tok.eos_token_id and first["loss_mask"][0] == 0
    assert encode_rows(rows[:1], sections, tok, "rated")[0]["input_ids"] == first["input_ids"]


def test_every_data_module_names_a_registered_format_and_unknown_kinds_are_refused():
    assert {cls.kind for cls in (SFTData, DPOData, GRPOData, KTOData)} == set(ROW_FORMATS)
    assert all(f.kind == kind for kind, f in ROW_FORMATS.items())
    with pytest.raises(ValueError, match="kind='rated'"):
        row_format("rated")
    with pytest.raises(ValueError, match="use one of"):
        next(generate_rows("rated", 1))


def test_shared_options_are_declared_once_and_passed_by_keyword():
    module = DPOData(path=None, batch_size=3, seed=7, max_seq_len=64, truncation="drop")
    assert (module.hparams.batch_size, module.hparams.seed, module.hparams.max_seq_len) == (3, 7, 64)
    assert set(RowsData().hparams) <= set(module.hparams)
    with pytest.raises(ValueError, match="batch_size=0"):
        GRPOData(batch_size=0)
    with pytest.raises(TypeError):
        SFTData("rows.jsonl")  # the shared options are keywords: no silent max_seq_len='rows.jsonl'
