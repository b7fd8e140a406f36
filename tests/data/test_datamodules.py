import json
import logging

import pandas as pd
import pytest
import torch

from astrai_pl.data import Arithmetic, DataError, DPOData, GRPOData, Section, SFTData
from astrai_pl.data.windows import WindowedLoader, windowed

SMALL = Arithmetic(train_rows=300, test_rows=20, max_operand=49)


def conversations(n):
    return [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Say {i}."},
                {"role": "assistant", "content": "ok " * (1 + i % 5)},
            ]
        }
        for i in range(n)
    ]


def write_jsonl(path, rows, broken_line=None):
    lines = [json.dumps(r) for r in rows]
    if broken_line is not None:
        lines[broken_line - 1] = '{"messages": [{"role": "user", "content": "unterminated'
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_sft_batches_train_only_the_assistant_turns(tmp_path, caplog):
    path = write_jsonl(tmp_path / "rows.jsonl", conversations(40))
    data = SFTData(path=path, max_seq_len=256, batch_size=4, val_fraction=0.2)
    with caplog.at_level(logging.INFO):
        data.prepare_data()
        data.setup("fit")
    assert (
        "[[ok " in caplog.text and "<|im_end|>\n]]" in caplog.text
    )  # the printed example, trained spans marked
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "document_ids", "position_ids"}  # no trainer: no window tag
    trained = batch["input_ids"][batch["labels"] != -100]
    text = data.tokenizer.decode(trained.tolist())
    assert "ok" in text and "Say" not in text and "Be brief" not in text
    assert len(data.train_set) + len(data.val_set) < 40  # packed: several conversations per example


def test_sft_sections_by_name_or_list_and_other_file_formats(tmp_path):
    rows = [{"prompt": f"Q{i}: 2+2?", "completion": " 4"} for i in range(30)]
    pd.DataFrame(rows).to_parquet(tmp_path / "rows.parquet")
    explicit = [Section("prompt", action="mask"), Section("completion", eos=True)]
    for sections in ("prompt_completion", explicit, None):
        data = SFTData(path=str(tmp_path / "rows.parquet"), sections=sections, packing="none", max_seq_len=32)
        data.setup()
        example = data.train_set[0]
        trained = [t for t, label in zip(example["input_ids"], example["labels"]) if label != -100]
        assert data.tokenizer.decode(trained) == " 4" + data.tokenizer.eos_token


def test_a_malformed_line_is_named_before_anything_trains(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", conversations(10), broken_line=3)
    data = SFTData(path=path)
    with pytest.raises(DataError, match=r"rows\.jsonl, line 3: malformed JSON"):
        data.prepare_data()
    skipping = SFTData(path=path, on_bad_row="skip", max_seq_len=96, val_fraction=0.3)
    skipping.setup()
    assert len(skipping.train_set) > 0


def test_a_row_without_trained_tokens_after_truncation_is_caught(tmp_path):
    rows = conversations(10)
    rows[4]["messages"][1]["content"] = "x" * 300  # the prompt alone fills max_seq_len
    data = SFTData(path=write_jsonl(tmp_path / "rows.jsonl", rows), max_seq_len=128, val_fraction=0.2)
    with pytest.raises(DataError, match=r"line 5.*no trained token left"):
        data.setup()


def test_a_tokenizer_larger_than_the_model_is_refused():
    from astrai_pl.data.sources import check_model_fit
    from astrai_pl.tokenizer import Tokenizer

    with pytest.raises(DataError, match="vocab_size is 100"):
        check_model_fit(Tokenizer.byte_level(), 100)


def test_train_batches_are_tagged_with_their_window(tmp_path):
    class FakeTrainer:
        accumulate_grad_batches = 3
        num_training_batches = float("inf")
        world_size = 1

    data = SFTData(synthetic=SMALL, max_seq_len=64, batch_size=8, cache_dir=str(tmp_path))
    data.trainer = FakeTrainer()
    data.setup()
    loader = data.train_dataloader()
    batches = list(loader)
    assert len(loader) == len(batches) == -(-len(data.train_set) // 8)
    for start in range(0, len(batches), 3):
        window = batches[start : start + 3]
        expected = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
        assert [b["window_tokens"] for b in window] == [expected] * len(window)


def test_dpo_pairs_share_the_prompt_and_train_only_the_responses(tmp_path):
    data = DPOData(synthetic=SMALL, batch_size=4, cache_dir=str(tmp_path))
    data.setup()
    batch = next(iter(data.val_dataloader()))
    assert (
        batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape == batch["chosen_labels"].shape
    )
    for i, n in enumerate(batch["prompt_lengths"].tolist()):
        assert torch.equal(batch["chosen_input_ids"][i, :n], batch["rejected_input_ids"][i, :n])
        assert (batch["chosen_labels"][i, :n] == -100).all() and (
            batch["rejected_labels"][i, :n] == -100
        ).all()
    tok = data.tokenizer
    chosen = tok.decode(batch["chosen_input_ids"][0][batch["chosen_labels"][0] != -100].tolist())
    rejected = tok.decode(batch["rejected_input_ids"][0][batch["rejected_labels"][0] != -100].tolist())
    assert chosen != rejected and chosen.endswith("<|im_end|>\n")


def test_dpo_rows_from_a_file_and_the_window_count(tmp_path):
    rows = [{"prompt": f"Pick {i}.", "chosen": " yes", "rejected": " no no"} for i in range(20)]
    data = DPOData(path=write_jsonl(tmp_path / "pairs.jsonl", rows), val_fraction=0.2, batch_size=3)

    class FakeTrainer:
        accumulate_grad_batches, num_training_batches, world_size = 2, float("inf"), 1

    data.trainer = FakeTrainer()
    data.setup()
    batches = list(data.train_dataloader())
    assert batches[0]["window_pairs"] == sum(len(b["prompt_lengths"]) for b in batches[:2])
    tok = data.tokenizer
    first = batches[0]
    assert tok.decode(first["rejected_input_ids"][0][first["rejected_labels"][0] != -100].tolist()) == (
        " no no" + tok.eos_token
    )


def test_grpo_batches_carry_prompts_and_answers(tmp_path):
    data = GRPOData(synthetic=SMALL, batch_size=5, cache_dir=str(tmp_path))
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert {"prompt_ids", "prompt_text", "answer"} <= set(batch)
    assert len(batch["prompt_ids"]) == len(batch["answer"]) == 5
    for ids, text, answer in zip(batch["prompt_ids"], batch["prompt_text"], batch["answer"]):
        assert text == data.tokenizer.decode(ids) and text.endswith("<|im_start|>assistant\n")
        a, op, b = text.split("What is ")[1].split("?")[0].split()
        assert str(int(a) + int(b) if op == "+" else int(a) - int(b)) == answer


def test_grpo_long_prompts_are_cut_from_the_left(tmp_path):
    rows = [{"prompt": "blah " * (5 + 20 * (i % 2)), "answer": str(i)} for i in range(20)]
    data = GRPOData(
        path=write_jsonl(tmp_path / "p.jsonl", rows), sections="grpo", max_prompt_len=40, val_fraction=0.2
    )
    data.setup()
    assert max(len(r["prompt_ids"]) for r in data.train_set) == 40
    assert all(data.tokenizer.decode(r["prompt_ids"]).endswith("assistant\n") for r in data.train_set)


# --- the window wrapper on its own ------------------------------------------------------------------


def fake_batches(counts):
    return [{"labels": torch.tensor([[-100] + [1] * c + [-100] * (9 - c)])} for c in counts]


def test_windows_follow_lightning_boundaries_including_a_short_last_one():
    batches = fake_batches([1, 2, 3, 4, 5, 6, 7])
    tags = [b["window_tokens"] for b in WindowedLoader(batches, lambda: 3)]
    assert tags == [6, 6, 6, 15, 15, 15, 7]
    limited = [b["window_tokens"] for b in WindowedLoader(batches, lambda: 3, limit=lambda: 5)]
    assert limited == [6, 6, 6, 9, 9]  # limit_train_batches=5: Lightning steps after batch 5


class StatefulList:
    """A resumable loader over a list: its state is the index of the next batch."""

    def __init__(self, items):
        self.items, self.position = items, 0

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        while self.position < len(self.items):
            self.position += 1
            yield self.items[self.position - 1]
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_state_passes_through_to_a_stateful_loader_and_resumes_mid_window():
    trainer = type("T", (), {"accumulate_grad_batches": 3, "num_training_batches": 7})()
    assert not hasattr(windowed(fake_batches([1]), trainer), "state_dict")
    straight = [b["window_tokens"] for b in windowed(StatefulList(fake_batches(range(1, 8))), trainer)]
    first = windowed(StatefulList(fake_batches(range(1, 8))), trainer)
    it = iter(first)
    seen = [next(it)["window_tokens"] for _ in range(4)]  # stopped inside the second window
    state = first.state_dict()
    assert state["inner"] == {"position": 3} and (state["start"], state["skip"]) == (3, 1)
    resumed = windowed(StatefulList(fake_batches(range(1, 8))), trainer)
    resumed.load_state_dict(state)
    assert seen + [b["window_tokens"] for b in resumed] == straight


def test_sft_train_loader_resumes_inside_a_window_with_the_same_batches_and_counts(tmp_path):
    class FakeTrainer:
        accumulate_grad_batches, num_training_batches, world_size = 3, float("inf"), 1

    data = SFTData(synthetic=SMALL, max_seq_len=64, batch_size=8, cache_dir=str(tmp_path))
    data.trainer = FakeTrainer()
    data.setup()

    def fingerprint(batch):
        return hash(tuple(batch["input_ids"].flatten().tolist())), batch["window_tokens"]

    straight = [fingerprint(b) for b in data.train_dataloader()]
    interrupted = data.train_dataloader()
    it = iter(interrupted)
    seen = [fingerprint(next(it)) for _ in range(4)]
    state = interrupted.state_dict()
    resumed = data.train_dataloader()
    resumed.load_state_dict(state)
    assert seen + [fingerprint(b) for b in resumed] == straight
