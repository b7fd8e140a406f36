"""KTOData: TRL's unpaired rows {prompt, completion, label}, the mismatched pairs of the KL estimate, bad labels."""

import json

import pytest
import torch

from astrai_pl.data import Arithmetic, DataError, KTOData, collate_unpaired
from astrai_pl.data.packing import IGNORE_INDEX
from astrai_pl.data.synthetic import generate_rows


def rows_file(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def text_row(prompt, completion, label):
    return {"prompt": prompt, "completion": completion, "label": label}


def test_the_built_in_task_holds_desirable_and_undesirable_examples():
    rows = list(generate_rows("kto", 60))
    assert all(set(r) == {"prompt", "completion", "label"} for r in rows)
    labels = [r["label"] for r in rows]
    assert 10 < sum(labels) < 50  # about half of each kind
    for row in rows:
        question = row["prompt"][0]["content"]
        a, op, b = question.removeprefix("What is ").removesuffix("?").split()
        right = str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert (row["completion"][0]["content"] == right) == row["label"]


def test_each_prompt_is_paired_with_the_previous_rows_completion():
    rows = [{"input_ids": [1, 10, 11, 12], "loss_mask": [0, 0, 1, 1], "prompt_length": 2, "label": True},
            {"input_ids": [1, 20, 21], "loss_mask": [0, 0, 1], "prompt_length": 2, "label": False},
            {"input_ids": [1, 30, 31, 32, 33], "loss_mask": [0, 0, 0, 1, 1], "prompt_length": 3, "label": True}]
    batch = collate_unpaired(rows, pad_id=0, max_seq_len=5)
    assert batch["KL_input_ids"].tolist() == [[1, 10, 32, 33, 0], [1, 20, 11, 12, 0], [1, 30, 31, 21, 0]]
    assert batch["KL_labels"][1].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 11, 12, IGNORE_INDEX]
    assert batch["labels"][0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 11, 12, IGNORE_INDEX]
    assert batch["label"].tolist() == [True, False, True]
    assert batch["input_ids"].shape == batch["KL_input_ids"].shape == (3, 5)


def test_text_rows_train_the_completion_and_its_eos(tmp_path):
    rows = [text_row(f"Q{i}: ", f"answer {i}", i % 2 == 0) for i in range(12)]
    data = KTOData(path=rows_file(tmp_path, rows), max_seq_len=32, batch_size=4, val_fraction=0.25,
                   cache_dir=str(tmp_path))
    data.setup()
    batch = next(iter(data.train_dataloader()))
    tok = data.tokenizer
    for labels in batch["labels"]:
        trained = [int(t) for t in labels if t != IGNORE_INDEX]
        assert trained[-1] == tok.eos_token_id and tok.decode(trained[:-1]).startswith("answer ")
    assert batch["label"].dtype == torch.bool


def test_a_label_that_is_not_a_json_boolean_names_the_line_and_the_field(tmp_path):
    rows = [text_row("Q: ", "a", "yes"), text_row("Q: ", "b", "no"), text_row("Q: ", "c", "yes")]
    data = KTOData(path=rows_file(tmp_path, rows), batch_size=2, val_fraction=0.3, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"line 1, field 'label': expected true or false, got str 'yes'"):
        data.setup()


def test_a_row_without_a_label_is_named(tmp_path):
    rows = [text_row("Q: ", "a", True), {"prompt": "Q: ", "completion": "b"}, text_row("Q: ", "c", False)]
    data = KTOData(path=rows_file(tmp_path, rows), batch_size=2, val_fraction=0.3, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"line 2, field 'label': missing field"):
        data.setup()


def test_on_bad_row_skip_drops_the_unlabelled_example(tmp_path):
    rows = [text_row(f"Q{i}: ", "a", i % 2 == 0) for i in range(10)] + [{"prompt": "Q: ", "completion": "x"}]
    data = KTOData(path=rows_file(tmp_path, rows), batch_size=2, val_fraction=0.2, on_bad_row="skip",
                   cache_dir=str(tmp_path))
    data.setup()
    assert len(data.train_set) + len(data.val_set) == 10


def test_truncation_drop_and_bad_options(tmp_path):
    with pytest.raises(ValueError, match="truncation='left'"):
        KTOData(truncation="left")
    kept = {}
    for limit in (64, 40):
        data = KTOData(synthetic=Arithmetic(train_rows=16, test_rows=4), max_seq_len=limit, truncation="drop",
                       batch_size=2, cache_dir=str(tmp_path))
        data.setup()
        kept[limit] = [len(ids) for ids in data.train_set["input_ids"]]
    assert max(kept[64]) > 40 >= max(kept[40]) and 0 < len(kept[40]) < len(kept[64])
