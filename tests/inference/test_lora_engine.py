"""The engine computes with a model's LoRA adapter: its greedy tokens and log-probabilities are those of the
model's own forward with the adapter, before and after an optimizer step moves the adapter, on the fused CPU
kernels and on PyTorch alone; a saved session is refused by an engine whose adapter computes otherwise."""

import contextlib
import copy

import pytest
import torch

from astrai_pl.inference import SamplingParams, SessionError
from astrai_pl.model.lora import LoraConfig, adapters_disabled, apply_lora, merge_lora
from astrai_pl.ops import cpu as cpu_ops

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9], list(range(30, 110))]  # the last: a prefill of more than 64 rows
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
ALL_LINEAR = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def adapted(model, lora: LoraConfig = ALL_LINEAR):
    """A copy of `model` with an adapter on every projection (B still zero)."""
    out = copy.deepcopy(model)
    apply_lora(out, lora)
    return out


def optimizer_step(model, lr: float = 0.05) -> None:
    """One AdamW step on the adapter, on the next-token loss of a random sequence: B becomes non-zero."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@torch.no_grad()
def forward_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by a full forward over the whole sequence at every step, and each token's log-prob."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    logps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    new = ids[len(prompt):]
    return new, [float(logps[len(prompt) - 1 + i, t]) for i, t in enumerate(new)]


def assert_engine_follows_the_model(engine, model) -> None:
    for out, prompt in zip(engine.generate(PROMPTS, GREEDY), PROMPTS):
        tokens, logps = forward_greedy(model, prompt, GREEDY.max_tokens)
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logps), atol=1e-4, rtol=0)


@contextlib.contextmanager
def cpu_kernels(on: bool):
    if on and not cpu_ops.available():
        pytest.skip(f"the fused CPU kernels do not run here: {cpu_ops.unavailable_reason()}")
    with cpu_ops.override_available(None if on else False):
        yield


@pytest.mark.parametrize("kernels", [True, False], ids=["panel-kernels", "pytorch"])
def test_engine_greedy_equals_the_adapted_forward_before_and_after_a_step(model, make_engine, kernels):
    adapted_model = adapted(model)
    with cpu_kernels(kernels):
        engine = make_engine(adapted_model)
        assert_engine_follows_the_model(engine, adapted_model)  # B zero: the base's tokens
        optimizer_step(adapted_model)
        engine.weights_changed()  # the prompts' cached K/V were computed with the adapter before the step
        assert_engine_follows_the_model(engine, adapted_model)
    with torch.no_grad(), adapters_disabled(adapted_model):
        base = [forward_greedy(adapted_model, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    assert base != [forward_greedy(adapted_model, p, GREEDY.max_tokens)[0] for p in PROMPTS]  # the step shows


def test_engine_on_the_merged_model_gives_the_adapted_tokens(model, make_engine):
    adapted_model = adapted(model)
    optimizer_step(adapted_model)
    merged = merge_lora(copy.deepcopy(adapted_model)).eval()
    for out, prompt in zip(make_engine(merged).generate(PROMPTS, GREEDY), PROMPTS):
        assert out.token_ids == forward_greedy(adapted_model, prompt, GREEDY.max_tokens)[0]


def test_engine_follows_an_adapter_on_some_projections_only(model, make_engine):
    """q and v adapted, k not: the engine's joined q/k/v product adds each projection's own delta."""
    adapted_model = adapted(model, LoraConfig(r=2, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    optimizer_step(adapted_model)
    assert_engine_follows_the_model(make_engine(adapted_model), adapted_model)


def saved_session(engine, path):
    chat = engine.session()
    chat.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))
    chat.save(path)
    chat.close()
    return path


def test_a_session_saved_with_one_adapter_is_refused_under_another(model, make_engine, tmp_path):
    first = adapted(model)
    optimizer_step(first)
    path = saved_session(make_engine(first), tmp_path / "chat.safetensors")
    make_engine(copy.deepcopy(first)).load_session(path).close()  # the same adapter: accepted
    moved = copy.deepcopy(first)
    optimizer_step(moved)  # the same base, the adapter one step further
    rescaled = copy.deepcopy(first)  # the same tensors, scaled otherwise (lora_alpha 16)
    rescaled.lora_config = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear")
    for module in rescaled.modules():
        if hasattr(module, "scaling"):
            module.scaling = rescaled.lora_config.scaling
    base = copy.deepcopy(model)
    for other in (moved, rescaled, base):
        with pytest.raises(SessionError, match="saved from a different model"):
            make_engine(other).load_session(path)


def test_a_session_saved_before_an_optimizer_step_is_refused_after_it(model, make_engine, tmp_path):
    adapted_model = adapted(model)
    engine = make_engine(adapted_model)
    path = saved_session(engine, tmp_path / "chat.safetensors")
    optimizer_step(adapted_model)
    with pytest.raises(SessionError, match="saved from a different model"):
        engine.load_session(path)


def varied_reward(prompts, completions, completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def test_grpo_rollouts_follow_the_adapter_after_an_optimizer_step():
    from astrai_pl.data.synthetic import problems
    from astrai_pl.model import ModelConfig
    from astrai_pl.objectives import GRPO
    from astrai_pl.objectives.evaluation import chat_prompts
    from astrai_pl.objectives.rollout import sample
    from astrai_pl.tokenizer import Tokenizer

    tokenizer = Tokenizer.byte_level()
    torch.manual_seed(0)
    module = GRPO(tokenizer=tokenizer, arch=ModelConfig.from_name("debug"), max_completion_length=6, beta=0.05,
                  reward_funcs=[varied_reward],
                  lora={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    questions = [p.question for p in problems(3, "train", 0)]
    batch = {"prompt": [[{"role": "user", "content": q}] for q in questions],
             "prompt_ids": chat_prompts(questions, tokenizer)}
    rollout = module.roll_out(batch)  # the engine is built on the live policy and caches the prompts
    optimizer = torch.optim.AdamW([p for p in module.model.parameters() if p.requires_grad], lr=0.05)
    loss, _ = module._shared_step({**rollout.micro_batches[0], "first_pass": True}, "train")
    loss.backward()
    optimizer.step()
    assert all(float(m.lora_B.weight.detach().abs().max()) > 0 for _, m in module.model.named_modules() if hasattr(m, "lora_B"))

    ids = batch["prompt_ids"]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    completions, _ = sample(module.rollout_engine(ids), ids, greedy)
    module.model.eval()
    with torch.no_grad():
        after = [forward_greedy(module.model, p, 8) for p in ids]
        with adapters_disabled(module.model):
            before = [forward_greedy(module.model, p, 8)[0] for p in ids]
    assert [c.token_ids for c in completions] == [tokens for tokens, _ in after]
    for c, (_, logps) in zip(completions, after):
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(logps), atol=1e-4, rtol=0)
    assert [tokens for tokens, _ in after] != before  # the step moved the greedy tokens: the adapter shows
