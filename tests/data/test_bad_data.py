"""Data a careless user brings — bytes that are not UTF-8, rows that are all dropped, rows without what
training needs — stops before step 1 with one DataError naming the file, the line, the field and the fix."""

import json
import logging
import re
from pathlib import Path

import pytest
from fit_runs import quiet_trainer

from astrai_pl.cli import main
from astrai_pl.commands import generate_verb
from astrai_pl.data import DataError, DPOData, GRPOData, PretrainData, SFTData
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives import GRPO
from astrai_pl.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
NOT_UTF8 = "café".encode("latin-1")  # b"caf\xe9": 0xe9 does not start a UTF-8 sequence


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"ok {i}"}]}


def write(path: Path, lines: list[bytes]) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def rows_file(tmp_path: Path, suffix: str, n: int = 40, bad_line: int = 3) -> str:
    """`n` SFT rows (JSON lines, or plain text for .txt) whose line `bad_line` holds a byte that is not UTF-8."""
    if suffix == ".txt":
        lines = [f"plain text row {i}".encode() for i in range(n)]
        lines[bad_line - 1] = b"plain text row " + NOT_UTF8
    else:
        lines = [json.dumps(chat(i)).encode() for i in range(n)]
        lines[bad_line - 1] = lines[bad_line - 1].replace(b"Say", NOT_UTF8)
    return write(tmp_path / f"rows{suffix}", lines)


def sft(path: str, tmp_path: Path, **kw) -> SFTData:
    sections = "text" if path.endswith(".txt") else None
    return SFTData(path=path, sections=sections, cache_dir=str(tmp_path / "cache"), val_fraction=0.2, **kw)


# -- bytes that are not UTF-8 ----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".txt"])
def test_a_line_that_is_not_utf8_is_named_with_file_and_line(tmp_path, suffix):
    path = rows_file(tmp_path, suffix)
    with pytest.raises(DataError, match=rf"{re.escape(path)}, line 3: not valid UTF-8 \(byte 0xe9 at column \d+\)"):
        sft(path, tmp_path).setup()


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".txt"])
def test_skip_drops_and_counts_the_lines_that_are_not_utf8(tmp_path, caplog, suffix):
    data = sft(rows_file(tmp_path, suffix), tmp_path, on_bad_row="skip", packing="none")
    with caplog.at_level(logging.WARNING):
        data.setup()
    assert len(data.train_set) + len(data.val_set) == 39
    assert "skipped 1 bad row(s)" in caplog.text and "line 3: not valid UTF-8" in caplog.text


def test_pretrain_names_the_line_that_is_not_utf8(tmp_path):
    lines = [f"document {i} of a corpus".encode() for i in range(50)]
    lines[4] = NOT_UTF8
    path = write(tmp_path / "corpus.txt", lines)
    with pytest.raises(DataError, match=rf"{re.escape(path)}, line 5: not valid UTF-8"):
        PretrainData(path=path, seq_len=8, cache_dir=str(tmp_path / "cache")).setup()


def test_generate_input_names_the_line_that_is_not_utf8(tmp_path):
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path / "model", tokenizer=Tokenizer.byte_level())
    src = write(tmp_path / "prompts.jsonl", [b'{"prompt": "fine"}', b'{"prompt": "' + NOT_UTF8 + b'"}'])
    with pytest.raises(SystemExit, match=rf"{re.escape(src)}:2: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        generate_verb(["--model", str(tmp_path / "model"), "--input", src, "--max-tokens", "2"])


# -- every row dropped -----------------------------------------------------------------------------------


def test_every_row_dropped_stops_sft_with_the_count_of_each_reason(tmp_path):
    user_only = {"messages": [{"role": "user", "content": "a question and no answer"}]}
    long = {"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "ok"}]}
    lines = [b'{"messages": [', b"[1, 2]", NOT_UTF8] + [json.dumps(r).encode() for r in [user_only] * 10 + [long] * 30]
    data = sft(write(tmp_path / "rows.jsonl", lines), tmp_path, on_bad_row="skip", max_seq_len=64, truncation="drop")
    with pytest.raises(DataError, match="no train examples left") as caught:
        data.setup()
    message = str(caught.value)
    assert "malformed JSON (1)" in message and "not valid UTF-8 (1)" in message
    assert "expected a JSON object per line (1)" in message
    assert re.search(r"the row trains no token \('messages'\) \(\d+\)", message)
    assert re.search(r"longer than max_seq_len=64 with truncation='drop' \(\d+\)", message)


def test_the_cli_stops_in_one_line_when_every_sft_row_is_dropped(tmp_path):
    long = {"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "ok"}]}
    path = write(tmp_path / "rows.jsonl", [json.dumps(long).encode()] * 40)
    args = ["fit", "--config", str(ROOT / "configs/sft/debug.yaml"), "--data.init_args.path", path,
            "--data.init_args.truncation", "drop", "--data.init_args.max_seq_len", "64",
            "--data.init_args.val_fraction", "0.2", "--data.init_args.cache_dir", str(tmp_path / "cache"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_checkpointing", "false", "--trainer.max_steps", "1"]
    with pytest.raises(SystemExit, match=r"^astrai-pl: .*rows\.jsonl: no train examples left; rows dropped: "
                                         r"empty, or longer than max_seq_len=64 with truncation='drop' \(\d+\)"):
        main(args)


@pytest.mark.parametrize("module, row, limit, what", [
    (GRPOData, {"answer": "1"}, "max_prompt_len", "prompts"),
    (DPOData, {"chosen": "yes", "rejected": "no"}, "max_seq_len", "pairs"),
])
def test_every_row_dropped_stops_grpo_and_dpo_before_step_1(tmp_path, module, row, limit, what):
    rows = [{"prompt": "a long prompt " * 4, **row} for _ in range(40)]
    path = write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows])
    data = module(path=path, truncation="drop", val_fraction=0.2, cache_dir=str(tmp_path), **{limit: 8})
    with pytest.raises(DataError, match=rf"no train {what} left; rows dropped: longer than {limit}=8 "
                                        r"\(truncation='drop'\) \(\d+\)"):
        data.setup()


def test_a_corpus_shorter_than_one_window_stops_pretrain_before_step_1(tmp_path):
    path = write(tmp_path / "corpus.txt", [b"a few words"] * 40)
    with pytest.raises(DataError, match=r"corpus\.txt, field 'seq_len': no train windows: the \d+ train document"):
        PretrainData(path=path, seq_len=4096, val_fraction=0.2, cache_dir=str(tmp_path / "cache")).setup()


# -- rows without what training needs --------------------------------------------------------------------


def grpo_rows(tmp_path: Path, without_answer: list[int]) -> str:
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
    for line in without_answer:
        del rows[line - 1]["answer"]
    return write(tmp_path / "prompts.jsonl", [json.dumps(r).encode() for r in rows])


@pytest.mark.parametrize("without_answer, line", [(list(range(1, 41)), 1), ([3], 3)])
def test_grpo_rows_without_answer_are_refused_at_setup(tmp_path, without_answer, line):
    data = GRPOData(path=grpo_rows(tmp_path, without_answer), batch_size=2, val_fraction=0.2, cache_dir=str(tmp_path))
    module = GRPO(arch=ModelConfig.from_name("debug"), tokenizer=data.tokenizer, max_completion_length=4)
    with pytest.raises(DataError, match=rf"prompts\.jsonl, line {line}, field 'answer': missing field "
                                        r"\(reward function exact_match_reward reads it"):
        quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, datamodule=data)
    assert module.reward_history == []  # nothing was rolled out


def test_grpo_rows_without_answer_are_dropped_and_counted_under_skip(tmp_path, caplog):
    data = GRPOData(path=grpo_rows(tmp_path, [3]), on_bad_row="skip", val_fraction=0.2, cache_dir=str(tmp_path))
    data.trainer = quiet_trainer(max_steps=1)
    data.trainer.strategy.connect(GRPO(arch=ModelConfig.from_name("debug"), tokenizer=data.tokenizer))
    with caplog.at_level(logging.WARNING):
        data.setup()
    assert len(data.train_set) + len(data.val_set) == 39
    assert "skipped 1 bad row(s)" in caplog.text and "line 3, field 'answer'" in caplog.text


def test_a_missing_assistant_turn_is_named_not_blamed_on_max_seq_len(tmp_path):
    rows = [chat(i) for i in range(40)]
    rows[3]["messages"] = rows[3]["messages"][:1]
    data = sft(write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows]), tmp_path)
    with pytest.raises(DataError, match=r"line 4, field 'messages': the row trains no token: it has no assistant "
                                        r"message in 'messages'") as caught:
        data.setup()
    assert "max_seq_len" not in str(caught.value)
