import pytest

from astrai_pl.data.formats import encode_preference, encode_prompt, encode_row, infer_sections
from astrai_pl.data.preflight import check_tokenizer
from astrai_pl.data.sources import Arithmetic
from astrai_pl.data.synthetic import (
    Problem,
    accuracy,
    exact_match,
    extract_answer,
    generate_rows,
    held_out_set,
    is_held_out,
    problems,
    synthetic_dataset,
)
from astrai_pl.model import ConfigError
from astrai_pl.tokenizer import Tokenizer


def test_problems_are_seeded_correct_and_the_held_out_split_is_disjoint():
    train = problems(3000, "train", seed=1, ops=("+", "-", "*"))
    test = problems(500, "test", seed=1, ops=("+", "-", "*"))
    assert train == problems(3000, "train", seed=1, ops=("+", "-", "*"))
    assert train != problems(3000, "train", seed=2, ops=("+", "-", "*"))
    assert not set(train) & set(test)
    assert {p.op for p in train} == {"+", "-", "*"}
    assert Problem(37, "+", 48).question == "What is 37 + 48?" and Problem(37, "+", 48).answer == "85"
    assert Problem(3, "-", 9).answer == "-6" and Problem(12, "*", 11).answer == "132"
    with pytest.raises(ValueError, match="split"):
        problems(1, "validation")


def test_train_ranges_split_the_training_problems_and_leave_the_held_out_ones_alone():
    options = dict(ops=("+", "-"), max_operand=14)
    whole = set(problems(20000, "train", seed=0, **options))
    first = set(problems(20000, "train", seed=0, train_range=(0.0, 0.5), **options))
    second = set(problems(20000, "train", seed=0, train_range=(0.5, 1.0), **options))
    assert first and second and not first & second and first | second == whole
    assert 0.35 < len(first) / len(whole) < 0.65
    assert problems(500, "train", seed=3, **options) == problems(500, "train", seed=3, train_range=(0, 1), **options)
    held_out = problems(300, "test", seed=0, **options)
    assert held_out == problems(300, "test", seed=0, train_range=(0.0, 0.5), **options)
    sft_rows = list(generate_rows("sft", 300, seed=0, train_range=(0.0, 0.5), **options))
    for row in sft_rows:  # follow-up questions come from the same part
        for turn in row["messages"][::2]:
            a, op, b = turn["content"].removeprefix("What is ").removesuffix("?").split()
            assert Problem(int(a), op, int(b)) in first
    with pytest.raises(ValueError, match="no train problem in 100,000 draws"):  # an empty part: refused, not a hang
        problems(3, "train", max_operand=1, train_range=(0.9999, 1.0))
    with pytest.raises(ValueError, match="no test problem"):
        problems(3, "test", max_operand=1, held_out_fraction=0.0001)
    for bad in ((0.5, 0.5), (-0.1, 0.5), (0.2, 1.1), (0.1,)):
        with pytest.raises(ValueError, match="train_range"):
            problems(1, "train", train_range=bad)
    with pytest.raises(ConfigError, match="Arithmetic.train_range"):
        Arithmetic(train_range=(0.6, 0.4))
    assert Arithmetic(train_range=(0.0, 0.5)).problems("train", 0, 50) == problems(
        50, "train", 0, max_operand=99, train_range=(0.0, 0.5))


def test_the_held_out_set_is_every_held_out_problem_once():
    """What the demo scores: each held-out problem of the range once, where the test rows repeat some problems
    and may miss others."""
    options = dict(ops=("+", "-"), max_operand=14)
    every = held_out_set(**options)
    assert len(every) == len(set(every)) == 48 and all(is_held_out(p) for p in every)
    drawn = problems(5000, "test", seed=7, **options)
    assert set(drawn) == set(every) and len(drawn) > len(every)
    assert not set(every) & set(problems(5000, "train", seed=7, **options))
    assert every == sorted(every, key=lambda p: (p.a, "+-".index(p.op), p.b))
    wider = held_out_set(("+", "-", "*"), 20, held_out_fraction=0.3)
    assert {p.op for p in wider} == {"+", "-", "*"} and 0.25 < len(wider) / (3 * 21 * 21) < 0.35
    assert Arithmetic(max_operand=14).held_out_set() == every
    with pytest.raises(ValueError, match="held_out_set: 3 x 100,001"):  # 3e10 problems: refused, not an hours-long loop
        held_out_set(("+", "-", "*"), 100_000)


def test_rows_of_each_kind_encode_with_the_inferred_sections():
    tok = Tokenizer.byte_level()
    sft, dpo, grpo = (next(generate_rows(kind, 1, seed=3)) for kind in ("sft", "dpo", "grpo"))
    question = sft["messages"][0]["content"]
    assert dpo["prompt"][0]["content"] == grpo["prompt"][0]["content"] == question
    assert dpo["chosen"][0]["content"] == grpo["answer"] == sft["messages"][1]["content"]
    assert dpo["rejected"][0]["content"] != dpo["chosen"][0]["content"]
    for row, kind, encode in (
        (sft, "sft", encode_row),
        (dpo, "dpo", encode_preference),
        (grpo, "grpo", encode_prompt),
    ):
        sections = infer_sections(row, kind)
        check_tokenizer(tok, sections)
        assert encode(row, sections, tok)


def test_synthetic_dataset_is_cached_by_its_arguments(tmp_path):
    first = synthetic_dataset("grpo", 50, split="test", cache_dir=str(tmp_path))
    again = synthetic_dataset("grpo", 50, split="test", cache_dir=str(tmp_path))
    assert first.cache_files == again.cache_files and first["answer"] == again["answer"]
    assert first.column_names == ["prompt", "answer"]
    assert len(synthetic_dataset("sft", 30, ops=["+", "*"], cache_dir=str(tmp_path))) == 30


def test_answer_extraction_and_exact_match():
    assert extract_answer("The answer is 85.") == "85"
    assert extract_answer("37 + 48 = 85") == "85"
    assert extract_answer("it is -12") == "-12"
    assert extract_answer("1,234") == "1234"
    assert extract_answer("no idea") is None
    assert exact_match("85<|im_end|>", "85") == 1.0 and exact_match("84", 85) == 0.0
    assert accuracy(["85", "7", "x"], ["85", "8", "1"]) == pytest.approx(1 / 3)
