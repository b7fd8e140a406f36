"""The demo's own checks and data, without training: a post-training stage helps only when it keeps held-out
accuracy within a point and raises it (or its own figure); DPO's pairs come from the model's own wrong answers;
SFT's conversations hold follow-up questions, none of them held out."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from astrai_pl.cli import lightning_main
from astrai_pl.commands import chat_ids
from astrai_pl.data.formats import encode_rows, infer_sections
from astrai_pl.data.synthetic import FOLLOW_UP_EVERY, Problem, generate_rows, is_held_out, policy_pairs
from astrai_pl.demo import (
    CONFIGS,
    STAGE_OVERRIDES,
    held_out_reward,
    report_failures,
    sampled_answers,
    stage_failure,
    stage_table,
    training_record,
    write_policy_pairs,
)
from astrai_pl.evaluation.tasks import small_arithmetic_rows
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import Tokenizer


@pytest.mark.parametrize("before, after, own, failed", [
    (0.835, 0.870, False, False),  # held-out accuracy rose
    (0.835, 0.835, True, False),   # kept, and its own figure rose
    (0.835, 0.830, True, False),   # half a point lost: within a point
    (0.835, 0.835, False, False),  # nothing rose: a matter of the average over seeds, not of one run
    (0.835, 0.810, True, True),    # 2.5 points lost, whatever else rose
])
def test_a_stage_fails_when_it_loses_more_than_a_point(capsys, before, after, own, failed):
    failure = stage_failure("dpo", before, after, "rewards/accuracies above 0.5", own)
    assert (failure is not None) == failed
    out = capsys.readouterr().out
    assert f"within a point of where it started or above: {'NO' if failed else 'yes'}" in out
    assert f"rewards/accuracies above 0.5: {'yes' if own else 'no'}" in out
    if failed:
        assert "fell by 2.5%" in failure and "fell by 2.5%" in out


def test_policy_pairs_reject_the_models_own_wrong_answers_most_frequent_first():
    problems = [Problem(2, "+", 3), Problem(9, "-", 4)]
    samples = [["5", " 6", "6", "7", "5"], ["5", "5"]]  # the second problem: never wrong, no pair
    rows = policy_pairs(problems, samples, per_problem=2)
    assert [r["rejected"][0]["content"] for r in rows] == ["6", "7"]
    assert all(r["chosen"] == [{"role": "assistant", "content": "5"}] for r in rows)
    assert rows[0]["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert policy_pairs(problems, samples, per_problem=1) == rows[:1]
    with pytest.raises(ValueError, match="2 problems"):
        policy_pairs(problems, samples[:1])


def test_sft_conversations_ask_follow_ups_from_the_training_split_only():
    rows = list(generate_rows("sft", 600, seed=5, max_operand=14))
    assert rows == list(generate_rows("sft", 600, seed=5, max_operand=14))
    two_turn = [r for r in rows if len(r["messages"]) == 4]
    assert 600 / FOLLOW_UP_EVERY / 2 < len(two_turn) < 600 / FOLLOW_UP_EVERY * 2
    assert all(len(r["messages"]) in (2, 4) for r in rows)
    for row in two_turn:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user", "assistant"]
    for row in rows:
        for question, answer in zip(row["messages"][::2], row["messages"][1::2]):
            a, op, b = question["content"].removeprefix("What is ").removesuffix("?").split()
            problem = Problem(int(a), op, int(b))
            assert answer["content"] == problem.answer and not is_held_out(problem)
    firsts = [r["messages"][0]["content"] for r in rows]  # the first questions are the problems of the split
    assert firsts == [r["prompt"][0]["content"] for r in generate_rows("grpo", 600, seed=5, max_operand=14)]


def test_sampled_answers_are_n_per_problem_and_repeat_with_their_seed():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug"))
    tokenizer = Tokenizer.byte_level()
    problems = [Problem(2, "+", 3), Problem(9, "-", 4), Problem(7, "+", 7)]
    answers = sampled_answers(model, tokenizer, problems, n=3, seed=11)
    assert [len(group) for group in answers] == [3, 3, 3] and model.training
    assert answers == sampled_answers(model, tokenizer, problems, n=3, seed=11)
    assert answers != sampled_answers(model, tokenizer, problems, n=3, seed=12)


def test_grpos_held_out_reward_is_the_share_of_right_sampled_answers_with_fixed_draws(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug"))
    tokenizer = Tokenizer.byte_level()
    problems = [Problem(2, "+", 3), Problem(7, "-", 4)]
    assert held_out_reward(model, tokenizer, problems, samples=4, seed=5) == \
        held_out_reward(model, tokenizer, problems, samples=4, seed=5)  # the same draws, the same figure
    drawn = {}

    def answers(model, tokenizer, problems, n, seed):
        drawn.update(n=n, seed=seed)
        return [["5", "5", "4"], ["3", "three", "3 apples"]]

    monkeypatch.setattr("astrai_pl.demo.sampled_answers", answers)
    assert held_out_reward(model, tokenizer, problems, samples=3, seed=9) == pytest.approx(4 / 6)
    assert drawn == {"n": 3, "seed": 9}


def test_a_follow_up_is_trained_as_chat_asks_it():
    """The ids `astrai-pl chat` sends for a second question (the conversation through the chat template with its
    generation prompt) are the start of the SFT row that holds that conversation, its second answer next."""
    tokenizer = Tokenizer.byte_level()
    row = next(r for r in generate_rows("sft", 50, seed=1, max_operand=14) if len(r["messages"]) == 4)
    (encoded,) = encode_rows([row], infer_sections(row, "sft"), tokenizer, "sft")
    asked = chat_ids(tokenizer, row["messages"][:3])
    assert encoded["input_ids"][:len(asked)] == asked
    answer = tokenizer.encode(row["messages"][3]["content"], add_special_tokens=False)
    assert encoded["input_ids"][len(asked):len(asked) + len(answer)] == answer
    assert all(encoded["loss_mask"][len(asked):len(asked) + len(answer)])


def test_the_dpo_stage_trains_on_the_pairs_its_starting_model_gave(tmp_path):
    cli = lightning_main(["--config", str(CONFIGS / "dpo" / "debug.yaml"), "--data.init_args.synthetic.train_rows",
                          "24", "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "2",
                          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"],
                         run=False)
    path = write_policy_pairs(cli, samples=2, seed=0, epochs=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = math.ceil(len(rows) / cli.datamodule.hparams.batch_size)  # one pass over the pairs
    assert cli.trainer.max_steps == steps != 2
    assert rows and cli.datamodule.hparams.path == str(path) and path.parent == Path(cli.trainer.logger.log_dir)
    train = {p.question for p in cli.datamodule.synthetic.problems("train", 0)}
    for row in rows:
        question = row["prompt"][0]["content"]
        assert question in train and row["chosen"] != row["rejected"]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == steps and len(cli.datamodule.train_set) + len(cli.datamodule.val_set) == len(rows)


def test_a_training_stage_records_its_held_out_figure_first():
    cli = SimpleNamespace(trainer=SimpleNamespace(callbacks=[], global_step=80))
    record = training_record("dpo", cli, "accuracy 83.5% -> 86.0%", "rewards/accuracies 0.00 -> 0.69", 0.0)
    assert (record.stage, record.held_out, record.result, record.steps) == (
        "dpo", "accuracy 83.5% -> 86.0%", "rewards/accuracies 0.00 -> 0.69", 80)
    assert stage_table([record]).splitlines()[2].split()[:5] == ["dpo", "accuracy", "83.5%", "->", "86.0%"]


def test_a_lost_point_is_reported_and_fails_the_demo_only_when_strict(capsys):
    failure = "dpo: held-out accuracy fell by 2.5% (83.5% -> 81.0%)"
    report_failures([], strict=True)  # nothing lost: nothing said
    assert capsys.readouterr().out == ""
    report_failures([failure], strict=False)
    assert failure in capsys.readouterr().out
    with pytest.raises(SystemExit, match="fell by 2.5%"):
        report_failures([failure], strict=True)


def test_sft_learns_from_most_training_problems_and_the_later_stages_from_all_of_them(tmp_path):
    """The demo's SFT, DPO and GRPO stages, parsed as it runs them: SFT trains on most of the training problems
    and the later stages on every one (some SFT never saw), all hold out the same problems, which the demo
    scores each once: lm-eval's astrai_arithmetic_small."""
    base = tmp_path / "base"
    Transformer(ModelConfig.from_name("debug")).save_pretrained(base, tokenizer=Tokenizer.byte_level())
    stages = {}
    for stage in ("sft", "dpo", "grpo"):
        args = ["--config", str(CONFIGS / stage / "tiny.yaml"), "--model.init_args.init_from", str(base),
                "--trainer.logger", "false", *STAGE_OVERRIDES[stage]]
        stages[stage] = lightning_main(args, run=False).datamodule.synthetic
    train = {stage: set(task.problems("train", 0)) for stage, task in stages.items()}
    assert train["dpo"] == train["grpo"] > train["sft"]
    assert 0.7 < len(train["sft"]) / len(train["dpo"]) < 0.9
    held_out = {stage: task.problems("test", 0) for stage, task in stages.items()}
    assert held_out["sft"] == held_out["dpo"] == held_out["grpo"]
    assert not set(held_out["sft"]) & set().union(*train.values())
    scored = {stage: task.held_out_set() for stage, task in stages.items()}
    assert scored["sft"] == scored["dpo"] == scored["grpo"] and set(scored["sft"]) == set(held_out["sft"])
    assert [{"question": p.question, "answer": p.answer} for p in scored["sft"]] == small_arithmetic_rows()
