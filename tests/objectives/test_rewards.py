"""Reward functions: the built-ins, loading by import path, weighted combination and the errors."""

import math

import pytest
import torch

from astrai_pl.objectives import GRPO
from astrai_pl.objectives.rewards import (
    RewardError,
    closeness_reward,
    exact_match_reward,
    format_reward,
    length_penalty,
    load_reward_funcs,
    reward_metrics,
    score,
)

PATH = "astrai_pl.objectives.rewards"


def test_exact_match_reads_the_last_integer_of_text_or_messages():
    completions = ["85", "It is 85.", "84", [{"role": "assistant", "content": "so 1,085"}], "none"]
    answers = ["85", "85", "85", "1085", None]
    assert exact_match_reward([None] * 5, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, None]


def test_closeness_gives_partial_credit_by_distance():
    completions = ["85", "80", "It is 90", "70", "no number"]
    assert closeness_reward([None] * 5, completions, answer=["85"] * 5) == [1.0, 0.5, 0.5, 0.0, 0.0]
    assert closeness_reward([None], ["-3"], answer=["-1"], scale=4.0) == [0.5]


def test_format_reward_wants_one_integer_and_nothing_else():
    assert format_reward([None] * 5, ["85", " -3\n", "85.", "8 5", "x"]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_length_penalty_is_zero_within_the_target_then_linear_down_to_minus_one():
    ids = [[0] * n for n in (2, 4, 6, 20)]
    assert length_penalty([None] * 4, [""] * 4, completion_ids=ids, target=4, scale=4.0) == [0.0, 0.0, -0.5, -1.0]


def test_loading_by_import_path_and_with_bound_keyword_arguments():
    funcs, weights = load_reward_funcs(
        [f"{PATH}.exact_match_reward", {"path": f"{PATH}.length_penalty", "kwargs": {"target": 1, "scale": 1.0}},
         f"{PATH}.exact_match_reward"], [1.0, 0.5, 2.0])
    assert [name for name, _ in funcs] == ["exact_match_reward", "length_penalty", "exact_match_reward_2"]
    assert weights == [1.0, 0.5, 2.0]
    assert funcs[1][1](prompts=[None], completions=[""], completion_ids=[[1, 2]]) == [-1.0]


@pytest.mark.parametrize("spec, message", [
    ("astrai_pl.objectives.no_such_module.f", r"cannot import module 'astrai_pl\.objectives\.no_such_module'"),
    (f"{PATH}.no_such_function", r"has no attribute 'no_such_function'"),
    ("exact_match_reward", r"not an import path"),
    (f"{PATH}._INTEGER", r"is a Pattern, not a function"),
    ({"function": f"{PATH}.format_reward"}, r"give an import path or \{path"),
])
def test_a_bad_reward_path_is_named_with_its_index(spec, message):
    with pytest.raises(RewardError, match=r"GRPO\.reward_funcs\[1\]=.*" + message):
        load_reward_funcs([f"{PATH}.format_reward", spec])


def test_weights_must_match_the_functions_and_the_list_must_not_be_empty():
    with pytest.raises(RewardError, match=r"reward_weights has 1 entries for 2 reward_funcs"):
        load_reward_funcs([f"{PATH}.format_reward", f"{PATH}.exact_match_reward"], [1.0])
    with pytest.raises(RewardError, match="reward_funcs is empty"):
        load_reward_funcs([])


def test_grpo_rejects_an_unknown_reward_path_before_loading_any_weights():
    with pytest.raises(RewardError, match=r"GRPO\.reward_funcs\[0\]='my_rewards\.typo'"):
        GRPO(init_from="/nonexistent/model.ckpt", reward_funcs=["my_rewards.typo"])


def test_weighted_sum_skips_none_per_function_as_trl_does():
    def half(prompts, completions, **kwargs):
        return [0.5, None, 0.5, None]

    def trl_style(completions, **kwargs):  # no `prompts` parameter: called by keyword, so it works
        return [1.0, 1.0, 0.0, float("nan")]

    with pytest.warns(UserWarning, match="1 of 4 completions got None from every reward function"):
        per_func, total = score([("half", half), ("trl_style", trl_style)], [2.0, 1.0], [None] * 4, ["a"] * 4, {})
    assert per_func.shape == (4, 2) and per_func.isnan().sum() == 3
    assert total.tolist() == [2.0, 1.0, 1.0, 0.0]


def raises(prompts, completions, **kwargs):
    raise KeyError("answer")


def too_short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def not_numbers(prompts, completions, **kwargs):
    return ["good"] * len(completions)


@pytest.mark.parametrize("fn, message", [
    (raises, r"reward function 'raises' raised KeyError: 'answer'"),
    (too_short, r"reward function 'too_short' returned 2 rewards for 3 completions"),
    (not_numbers, r"reward function 'not_numbers' returned 'good' at index 0"),
])
def test_a_failing_reward_function_is_named(fn, message):
    with pytest.raises(RewardError, match=message):
        score([(fn.__name__, fn)], [1.0], [None] * 3, ["a"] * 3, {"answer": ["1"] * 3})


def test_reward_metrics_use_trl_names_and_population_statistics():
    per_func = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, math.nan], [1.0, 1.0]])  # (N=4, F=2), groups of 2
    total = torch.tensor([1.0, 2.0, 0.0, 2.0])
    m = reward_metrics(["em", "fmt"], per_func, total, group_size=2)
    assert m["rewards/em/mean"] == pytest.approx(0.75) and m["rewards/em/std"] == pytest.approx(math.sqrt(0.1875))
    assert m["rewards/fmt/mean"] == pytest.approx(2 / 3)
    assert m["reward"] == pytest.approx(1.25)
    assert m["reward_std"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["frac_reward_zero_std"] == 0.0
    same = reward_metrics(["em"], per_func[:, :1], torch.tensor([1.0, 1.0, 0.0, 0.0]), group_size=2)
    assert same["frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "heavy", None, True])
def test_a_weight_that_is_not_a_finite_number_is_refused_with_its_index(bad):
    specs = [f"{PATH}.format_reward", f"{PATH}.exact_match_reward"]
    with pytest.raises(RewardError, match=rf"GRPO\.reward_weights\[1\]={bad!r}: .*finite number"):
        load_reward_funcs(specs, [1.0, bad])
    with pytest.raises(RewardError, match=r"GRPO\.reward_weights\[1\]="):
        GRPO(init_from="/nonexistent/model.ckpt", reward_funcs=specs, reward_weights=[1.0, bad])
