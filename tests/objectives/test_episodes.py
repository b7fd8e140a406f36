"""Multi-turn GRPO episodes: the environment protocol, masking of what the environment wrote, one
computation per token on engine sessions, and an environment's failure ending its own episode only."""

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from fit_runs import quiet_trainer

from astrai_pl.data.synthetic import Problem, is_held_out, problems
from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives import GRPO
from astrai_pl.objectives.environments import EnvironmentSpecError, EnvStep, calculate, load_environment
from astrai_pl.objectives.episodes import render, run_episodes
from astrai_pl.objectives.evaluation import chat_prompts
from astrai_pl.objectives.logprobs import IGNORE_INDEX, token_logprobs
from astrai_pl.tokenizer import Tokenizer

TOKENIZER = Tokenizer.byte_level()
RESULT = "<result>84</result>"


class Scripted:
    """Answers the first model turn with a tool result, ends the episode at the second with reward 1."""

    def __init__(self, fail_on=None):
        self.fail_on = fail_on

    def step(self, messages, answer=None, **columns):
        if self.fail_on is not None and answer == self.fail_on:
            raise KeyError("scripted failure")
        if any(m["role"] == "tool" for m in messages):
            return EnvStep(done=True, reward=1.0)
        return EnvStep([{"role": "tool", "content": RESULT}])


def batch(n=2, seed=0):
    ps = problems(n, "train", seed)
    return {"prompt": [[{"role": "user", "content": p.question}] for p in ps], "answer": [p.answer for p in ps],
            "prompt_ids": chat_prompts([p.question for p in ps], TOKENIZER)}


def grpo(**kw) -> GRPO:
    torch.manual_seed(0)
    kw.setdefault("arch", ModelConfig.from_name("debug"))
    kw.setdefault("max_completion_length", 5)
    kw.setdefault("num_generations", 2)
    return GRPO(tokenizer=TOKENIZER, beta=0.0, **kw)


def test_environment_protocol_and_the_calculator():
    env = load_environment({"path": "astrai_pl.objectives.environments.Calculator", "kwargs": {"max_calls": 1}})
    assert env.name == "Calculator" and env.stop == ["</calc>"]
    user = {"role": "user", "content": "What is 12 * 7?"}
    step = env([user, {"role": "assistant", "content": "<calc>12*7</calc>"}], {"answer": "84"})
    assert step == EnvStep([{"role": "tool", "content": RESULT}])
    called = [user, {"role": "assistant", "content": "<calc>12*7</calc>"}, {"role": "tool", "content": RESULT}]
    assert env([*called, {"role": "assistant", "content": " 84"}], {"answer": "84"}) == EnvStep(done=True, reward=1.0)
    assert env([*called, {"role": "assistant", "content": " 85"}], {"answer": "84"}).reward == 0.0
    over = env([*called, {"role": "assistant", "content": "<calc>1+1</calc>"}], {"answer": "84"})
    assert over == EnvStep(done=True, reward=0.0)  # max_calls=1 spent
    bad = env([user, {"role": "assistant", "content": "<calc>2**99</calc>"}], {"answer": "84"})
    assert bad.messages == [{"role": "tool", "content": "<result>error</result>"}]
    assert calculate("-(3+4)*5 // 2") == -18
    for code in ("__import__('os')", "2**10", "(1).real", "9" * 20 + "*" + "9" * 20, "1//0"):
        with pytest.raises(ValueError):
            calculate(code)
    assert load_environment(lambda messages, **c: EnvStep(done=True)).stop == []
    broken = load_environment(lambda messages, **c: {"done": True})
    with pytest.raises(EnvironmentSpecError, match="EnvStep"):
        broken([user], {})
    with pytest.raises(EnvironmentSpecError, match="import path"):
        load_environment("runs/env.py")


def test_an_episode_masks_the_tool_output_and_trains_the_models_tokens():
    module = grpo(environment=Scripted(), max_turns=3, max_episode_tokens=64)
    rollout = module.roll_out(batch(), num_micro_batches=1)
    part = rollout.micro_batches[0]
    result_ids = TOKENIZER.encode(RESULT)
    for row in range(part["input_ids"].shape[0]):
        ids, labels = part["input_ids"][row].tolist(), part["labels"][row].tolist()
        start = next(i for i in range(len(ids)) if ids[i:i + len(result_ids)] == result_ids)
        span = range(start, start + len(result_ids))
        assert all(labels[i] == IGNORE_INDEX for i in span)  # the tool's tokens are not trained
        assert labels[start - 1] != IGNORE_INDEX and labels[start + len(result_ids)] != IGNORE_INDEX  # both turns
        assert all(part["scored"][row, i - 1] == 0 and part["rollout_logps"][row, i - 1] == 0 for i in span)
    assert rollout.metrics["episodes/mean_tool_calls"] == 1.0 and rollout.metrics["episodes/end_done"] == 1.0
    assert rollout.metrics["rewards/env_Scripted/mean"] == 1.0
    assert module.hparams["environment"].endswith("test_episodes.Scripted")  # plain: checkpoints load weights_only
    with torch.no_grad():  # the sessions' log-probs are those of the training forward, turn after turn
        logps = token_logprobs(module.model, part["input_ids"], part["labels"])
    assert float(((logps - part["rollout_logps"]).abs() * part["scored"]).max()) < 1e-4
    ones = torch.ones_like(part["advantages"])  # equal rewards give zero advantages: set some to train on
    loss, _ = module._shared_step({**part, "advantages": ones, "first_pass": True}, "train")
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.model.parameters())


def test_each_turn_computes_only_its_new_tokens():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug")).eval()
    engine = Engine(model, TOKENIZER, max_total_tokens=1024, prefix_cache=False)
    [prompt] = batch(1)["prompt_ids"]
    params = [SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, logprobs=True, seed=3)]
    before = engine.stats
    [episode] = run_episodes(engine, [prompt], [[{"role": "user", "content": "q"}]], [{}], load_environment(Scripted()),
                             params, max_turns=3, max_tokens=64)
    after = engine.stats
    added = len(TOKENIZER.encode(RESULT))
    assert episode.end == "done" and episode.trained.count(False) == added
    # turn 1 the prompt; turn 2 the tool's tokens and turn 1's last token (sampled, not yet computed)
    assert after.prefill_tokens - before.prefill_tokens == len(prompt) + added + 1
    computed = (after.prefill_tokens + after.decode_tokens) - (before.prefill_tokens + before.decode_tokens)
    assert computed == len(prompt) + len(episode.token_ids) - 1  # every token once, the last never
    assert not engine.sessions  # closed


def test_an_environment_error_ends_that_episode_only(caplog):
    data = batch(2)
    module = grpo(environment=Scripted(fail_on=data["answer"][0]), max_turns=3, max_episode_tokens=64,
                  reward_funcs=[])
    with caplog.at_level(logging.WARNING, logger="astrai_pl.objectives.episodes"):
        rollout = module.roll_out(data, num_micro_batches=1)
    assert "KeyError" in caplog.text and "scripted failure" in caplog.text
    assert rollout.metrics["episodes/errors"] == 2.0 and rollout.metrics["episodes/end_done"] == 0.5
    rewards = rollout.metrics["rewards/env_Scripted/mean"]
    assert rewards == 0.5  # the failed two score 0, the other two 1
    advantages = rollout.micro_batches[0]["advantages"]
    assert torch.all(advantages == 0)  # within each group the rewards are equal


def test_the_environment_options_are_checked():
    with pytest.raises(ValueError, match="max_turns"):
        grpo(environment=Scripted(), max_turns=0)
    with pytest.raises(ValueError, match="max_episode_tokens"):
        grpo(environment=Scripted(), max_episode_tokens=0)
    with pytest.raises(ValueError, match="reward_funcs is empty"):
        grpo(reward_funcs=[])  # only an environment may stand in for the reward functions
    module = grpo(environment=Scripted(), max_turns=3, max_completion_length=5)
    assert module.completion_length == 15


def test_the_episode_budget_bounds_the_tokens():
    module = grpo(environment=Scripted(), max_turns=3, max_episode_tokens=7, max_completion_length=5)
    rollout = module.roll_out(batch(1), num_micro_batches=1)
    assert rollout.metrics["completions/max_length"] <= 7
    assert rollout.metrics["episodes/end_max_tokens"] == 1.0  # 5 tokens + the 19-token result do not fit


@pytest.mark.slow
def test_grpo_fits_with_the_calculator(tmp_path):
    from astrai_pl.data import Arithmetic, GRPOData
    data = GRPOData(synthetic=Arithmetic(train_rows=100, test_rows=10), batch_size=2, cache_dir=str(tmp_path))
    module = grpo(environment="astrai_pl.objectives.environments.Calculator", max_turns=2, reward_funcs=[])
    trainer = quiet_trainer(devices=1, max_steps=2, limit_val_batches=1, val_check_interval=2,
                            num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    assert "val/reward" in trainer.callback_metrics


def test_a_user_message_opens_a_chat_template_turn_after_what_the_session_holds():
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    start = TOKENIZER.apply_chat_template(prompt, add_generation_prompt=True) + TOKENIZER.encode("5")
    messages, user = [*prompt, {"role": "assistant", "content": "5"}], {"role": "user", "content": "And 4 + 4?"}
    expected = TOKENIZER.apply_chat_template([*messages, user], add_generation_prompt=True, tokenize=False)
    held = start + TOKENIZER.encode("<|im_end|>")  # the model ended its turn as the template does
    ids = render([user], held, messages, TOKENIZER, chat=True)
    assert TOKENIZER.decode([*held, *ids]) == expected  # the session then holds the whole conversation
    held = [*start, TOKENIZER.eos_token_id]  # another stop token: the template's next turn follows it
    ids = render([user], held, messages, TOKENIZER, chat=True)
    assert TOKENIZER.decode(ids) == expected[len(TOKENIZER.apply_chat_template(messages, tokenize=False)):]
    assert render([{"role": "tool", "content": RESULT}], held, messages, TOKENIZER, chat=True) == \
        TOKENIZER.encode(RESULT)  # a tool result continues inline


def test_an_episode_that_never_ends_stops_at_max_turns():
    class Forever:
        def step(self, messages, **columns):
            return EnvStep([{"role": "tool", "content": "."}])

    module = grpo(environment=Forever(), max_turns=2, max_episode_tokens=64)
    rollout = module.roll_out(batch(1), num_micro_batches=1)
    assert rollout.metrics["episodes/end_max_turns"] == 1.0 and rollout.metrics["episodes/mean_turns"] <= 2
    assert rollout.metrics["completions/clipped_ratio"] == 1.0  # counted as truncated


def test_the_calculator_examples_sft_rows_are_what_its_environment_answers():
    """configs/sft/data/calculator-inline.jsonl answers train problems only, some through the call the
    Calculator answers, its result and the copy that earns reward 1, the rest directly (a policy that does
    not always call the tool, for GRPO to improve on); each GRPO calculator config starts where its SFT
    stage writes."""
    root = Path(__file__).resolve().parents[2]
    env = load_environment("astrai_pl.objectives.environments.Calculator")
    lines = (root / "configs/sft/data/calculator-inline.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    calls = 0
    for row in rows:
        a, op, b = row["prompt"].removeprefix("What is ").removesuffix("?").split(" ")
        problem = Problem(int(a), op, int(b))
        assert row["prompt"] == problem.question and not is_held_out(problem)
        user, columns = {"role": "user", "content": row["prompt"]}, {"answer": problem.answer}
        if "</calc>" not in row["completion"]:
            assert row["completion"] == problem.answer
            continue
        calls += 1
        call, rest = row["completion"].split("</calc>")
        turn = {"role": "assistant", "content": call + "</calc>"}
        [result] = env([user, turn], columns).messages
        assert rest.startswith(result["content"])  # the row's result is the tool's
        final = {"role": "assistant", "content": rest.removeprefix(result["content"])}
        assert env([user, turn, result, final], columns) == EnvStep(done=True, reward=1.0)
    assert len(rows) >= 1000 and 0.2 < calls / len(rows) < 0.8  # both kinds: GRPO learns to choose the tool
    for size in ("debug", "tiny"):
        sft = yaml.safe_load((root / f"configs/sft/tools-calculator-{size}.yaml").read_text())
        grpo_config = yaml.safe_load((root / f"configs/grpo/calculator-{size}.yaml").read_text())
        assert sft["data"]["init_args"]["path"] == "configs/sft/data/calculator-inline.jsonl"
        start = grpo_config["model"]["init_args"]["init_from"]
        assert start == f"{sft['trainer']['default_root_dir']}/latest/checkpoints/last.ckpt"
        environment = grpo_config["model"]["init_args"]["environment"]["path"]
        assert environment == "astrai_pl.objectives.environments.Calculator"
