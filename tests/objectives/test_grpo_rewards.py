"""GRPO's reward functions beyond plain callables: `async def` ones awaited together, and a Hugging Face
sequence-classification directory (a reward model) scoring prompt + completion."""

import asyncio

import pytest
import torch

from astrai_pl.model import ModelConfig
from astrai_pl.objectives import GRPO
from astrai_pl.objectives.evaluation import chat_prompts
from astrai_pl.objectives.rewards import RewardError, SequenceClassifierReward, load_reward_funcs, score
from astrai_pl.tokenizer import Tokenizer

TOKENIZER = Tokenizer.byte_level()
PROMPTS = ["What is 1 + 2?", "What is 3 + 4?"]
COMPLETIONS = ["3", "it is 7, I think"]

# Two async functions that each wait for the other to have started: awaited one after the other, the first
# would wait for ever (here: fail after 10 s); gathered, both finish at once.
_events: dict[str, asyncio.Event] = {}


async def _meet(me: str, other: str) -> None:
    _events.setdefault(me, asyncio.Event()).set()
    await asyncio.wait_for(_events.setdefault(other, asyncio.Event()).wait(), timeout=10)


async def first_async(prompts, completions, **kwargs):
    await _meet("first", "second")
    return [float(len(c)) for c in completions]


async def second_async(prompts, completions, **kwargs):
    await _meet("second", "first")
    return [None, 0.5]


def plain(prompts, completions, **kwargs):
    return [1.0] * len(completions)


async def broken(prompts, completions, **kwargs):
    raise KeyError("answer")


def test_async_reward_functions_are_awaited_together():
    _events.clear()
    funcs, weights = load_reward_funcs([first_async, plain, second_async], [1.0, 2.0, 4.0])
    per_func, total = score(funcs, weights, PROMPTS, COMPLETIONS, {})
    expected = torch.tensor([[1.0, 1.0, float("nan")], [16.0, 1.0, 0.5]])
    torch.testing.assert_close(per_func, expected, equal_nan=True)
    torch.testing.assert_close(total, torch.tensor([3.0, 20.0]))


def test_async_reward_functions_run_where_an_event_loop_already_runs():
    """As in a notebook, whose kernel runs an event loop in the thread that trains."""
    _events.clear()
    funcs, weights = load_reward_funcs([first_async, second_async])

    async def inside_a_loop():
        return score(funcs, weights, PROMPTS, COMPLETIONS, {})

    per_func, _ = asyncio.run(inside_a_loop())
    assert per_func[1, 0].item() == 16.0


def test_a_failing_async_reward_function_is_named():
    funcs, weights = load_reward_funcs([plain, broken])
    with pytest.raises(RewardError, match=r"reward function 'broken' raised KeyError: 'answer'"):
        score(funcs, weights, PROMPTS, COMPLETIONS, {})


# -- a reward model -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A tiny LlamaForSequenceClassification (one label) with the byte tokenizer, saved as safetensors."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, num_labels=1,
                                      pad_token_id=TOKENIZER.pad_token_id, bos_token_id=TOKENIZER.bos_token_id)
    model = transformers.LlamaForSequenceClassification(config).eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores far enough apart to tell completions apart
    folder = tmp_path_factory.mktemp("models") / "tiny-rm"
    model.save_pretrained(folder, safe_serialization=True)
    TOKENIZER.save_pretrained(folder)
    return folder, model


def direct_scores(model, texts: list[str]) -> list[float]:
    """transformers' own score of each text, one sequence at a time, BOS first."""
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([[TOKENIZER.bos_token_id, *TOKENIZER.encode(text)]])
            out.append(model(input_ids=ids).logits[0, 0].item())
    return out


def test_a_reward_model_directory_scores_prompt_and_completion(reward_dir):
    folder, model = reward_dir
    (name, fn), = load_reward_funcs([str(folder)])[0]
    assert name == "tiny-rm" and isinstance(fn, SequenceClassifierReward)
    rewards = fn(prompts=PROMPTS, completions=COMPLETIONS)  # batched, right-padded
    expected = direct_scores(model, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert rewards == pytest.approx(expected, abs=1e-5)
    assert rewards[0] != pytest.approx(rewards[1], abs=1e-3)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    turns = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    chat = fn(prompts=messages, completions=turns)
    rendered = [TOKENIZER.apply_chat_template([*m, *t], tokenize=False) for m, t in zip(messages, turns)]
    assert chat == pytest.approx(direct_scores(model, rendered), abs=1e-5)


def test_our_reward_model_export_scores_as_the_reward_model_does(tmp_path, capfd):
    from astrai_pl.objectives.reward import RewardModel, sequence_scores

    torch.manual_seed(0)
    rm = RewardModel(arch=ModelConfig.from_name("debug"), tokenizer=TOKENIZER)
    torch.nn.init.normal_(rm.model.lm_head.weight, std=1.0)
    rm.save_pretrained(tmp_path / "rm")
    capfd.readouterr()
    (_, fn), = load_reward_funcs([str(tmp_path / "rm")])[0]
    assert "Loading weights" not in capfd.readouterr().err  # no progress bar in a training log
    rewards = fn(prompts=PROMPTS, completions=COMPLETIONS)
    with torch.no_grad():
        ids = [[TOKENIZER.bos_token_id, *TOKENIZER.encode(p + c)] for p, c in zip(PROMPTS, COMPLETIONS)]
        expected = [float(sequence_scores(rm.model.eval(), torch.tensor([i]), torch.tensor([len(i) - 1]))[0])
                    for i in ids]
    assert rewards == pytest.approx(expected, abs=1e-5)


def test_grpo_trains_on_a_reward_model(reward_dir):
    folder, _ = reward_dir
    torch.manual_seed(0)
    module = GRPO(arch=ModelConfig.from_name("debug"), tokenizer=TOKENIZER, max_completion_length=4, beta=0.0,
                  reward_funcs=[{"path": str(folder), "kwargs": {"batch_size": 3}}])
    assert module.hparams["reward_funcs"] == [{"path": str(folder), "kwargs": {"batch_size": 3}}]
    batch = {"prompt": PROMPTS, "prompt_ids": chat_prompts(PROMPTS, TOKENIZER)}
    rollout = module.roll_out(batch)
    assert rollout.metrics["rewards/tiny-rm/std"] > 0  # the model's scores, one per completion


def test_what_is_not_a_reward_model_is_refused_naming_the_directory(reward_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    with pytest.raises(RewardError, match=r"not a directory with a config.json"):
        load_reward_funcs([str(tmp_path / "missing")])
    causal = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    causal.save_pretrained(tmp_path / "causal")
    with pytest.raises(RewardError, match=r"causal.*LlamaForCausalLM.*a reward model is a \*ForSequenceClassification"):
        load_reward_funcs([str(tmp_path / "causal")])
    folder, model = reward_dir
    pickled = tmp_path / "pickled"
    model.save_pretrained(pickled, safe_serialization=False)
    TOKENIZER.save_pretrained(pickled)
    if not list(pickled.glob("*.safetensors")):  # transformers 5 writes safetensors whatever it is told
        with pytest.raises(RewardError, match=r"no \.safetensors weights"):
            load_reward_funcs([str(pickled)])
    with pytest.raises(RewardError, match=r"batch_size=0"):
        load_reward_funcs([{"path": str(folder), "kwargs": {"batch_size": 0}}])
