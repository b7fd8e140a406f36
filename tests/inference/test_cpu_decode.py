"""The one-call decode layer (inference/attention/cpu_decode.py): the same logits as the module path, bit for bit, and
the module path wherever it does not apply."""

import copy
import dataclasses

import pytest
import torch

from astrai_pl.inference import SamplingParams
from astrai_pl.inference.attention import cpu_decode as cpu_decode_module
from astrai_pl.inference.attention.cpu_decode import unsupported
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.layers import RMSNorm
from astrai_pl.model.lora import LoraConfig, apply_lora
from astrai_pl.model.transformer import Block
from astrai_pl.ops import cpu as cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the fused CPU kernels do not build here")
GREEDY = dict(temperature=0, ignore_eos=True)


def _prompts(vocab: int, count: int, seed: int = 0, longest: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest, (count,), generator=g)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]


def _steps(monkeypatch) -> list[tuple[int, bool]]:
    """(rows, whether the one-call layer took the step) for every step offered to it."""
    seen = []
    real = cpu_decode_module.CpuDecode.hidden_states

    def recorded(self, input_ids, *args):
        out = real(self, input_ids, *args)
        seen.append((input_ids.shape[1], out is not None))
        return out

    monkeypatch.setattr(cpu_decode_module.CpuDecode, "hidden_states", recorded)
    return seen


# The debug preset (head width 16), and 64-wide heads in groups of 2 with contexts past the values loop's
# blocks of 16: the kernel's straight-line 64-column paths and several q/k/v panels.
WIDE_HEADS = dataclasses.replace(ModelConfig.from_name("debug"), hidden_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, intermediate_size=352)


@pytest.fixture
def threads(request):
    """torch's thread count for one test (the one-call layers' threads meet at their own barriers: with more
    threads than cores, some wait asleep)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape, threads", [("debug", 2), ("wide heads", 2), ("wide heads", 1), ("wide heads", 5)],
                         indirect=["threads"])
def test_same_logprobs_as_the_module_path(shape, threads, model, wide_model, make_engine, monkeypatch):
    """Greedy decoding of ragged prompts, some sharing a prefix, with a page size that splits contexts across
    pages and a step budget that makes some steps mixed (those run the modules): every token, its
    log-probability and the top-4 alternatives equal the module path's exactly, on one thread, two, and
    more threads than this machine has cores."""
    net = model if shape == "debug" else wide_model(WIDE_HEADS)
    steps = _steps(monkeypatch)
    prompts = _prompts(net.config.vocab_size, 12)
    prompts += [prompts[0][:20] + p for p in _prompts(net.config.vocab_size, 4, seed=1)]
    params = SamplingParams(max_tokens=24, logprobs=True, top_logprobs=4, **GREEDY)
    fused = make_engine(net, page_size=4, max_step_tokens=64).generate(prompts, params)
    taken = [n for n, took in steps if took]
    assert taken and max(taken) > 8 and min(taken) < 8  # the one-call layer ran, on many rows and on few
    plain_engine = make_engine(net, page_size=4, max_step_tokens=64)
    plain_engine.runner.cpu_decode = None
    plain = plain_engine.generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        assert list(a.logprobs) == list(b.logprobs)
        assert a.top_logprobs == b.top_logprobs


def test_greedy_equals_a_forward_without_cache(model, make_engine, reference_greedy, monkeypatch):
    steps = _steps(monkeypatch)
    prompts = _prompts(model.config.vocab_size, 6, seed=2)
    outs = make_engine(model, page_size=8).generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert any(took for _, took in steps)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(model, prompt, 12)


def test_more_rows_than_panels_take_the_module_path(model, make_engine, monkeypatch):
    """Above PANEL_MAX_ROWS decodes in a step the module path multiplies by the weights as stored, so the
    one-call layer steps aside (its rows would be summed in another order)."""
    steps = _steps(monkeypatch)
    prompts = _prompts(model.config.vocab_size, cpu_ops.PANEL_MAX_ROWS + 6, seed=3, longest=6)
    engine = make_engine(model, max_total_tokens=8192, max_batch_size=cpu_ops.PANEL_MAX_ROWS + 6)
    engine.generate(prompts, SamplingParams(max_tokens=3, **GREEDY))
    assert any(n > cpu_ops.PANEL_MAX_ROWS for n, _ in steps)  # such a step came
    assert all(not took for n, took in steps if n > cpu_ops.PANEL_MAX_ROWS)


def _debug(wide_model, **changes) -> Transformer:
    return wide_model(dataclasses.replace(ModelConfig.from_name("debug"), **changes))


@pytest.mark.parametrize("changes", [dict(qk_norm=True), dict(sliding_window=4), dict(attn_logit_softcapping=30.0),
                                     dict(query_pre_attn_scalar=24),
                                     dict(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5})])
def test_other_blocks_are_refused(changes, wide_model):
    assert unsupported(_debug(wide_model, **changes)) is not None


def test_biased_projections_run_the_modules(wide_model, make_engine, reference_greedy, monkeypatch):
    """Qwen2's q/k/v biases: the layer has no bias, so decode steps run the modules; the 80-token prompt's
    projections (oneDNN with the bias, above 64 rows) give the tokens of a forward without cache."""
    steps = _steps(monkeypatch)
    model = _debug(wide_model, attention_bias=True)
    with torch.no_grad():
        for block in model.layers:
            block.self_attn.q_proj.bias.normal_(0.0, 0.5)
            block.self_attn.k_proj.bias.normal_(0.0, 0.5)
    assert unsupported(model) is None  # the shape is fine; the biases are seen per step
    prompt = _prompts(model.config.vocab_size, 1, seed=4, longest=3)[0] * 40
    out = make_engine(model).generate([prompt[:80]], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert steps and not any(took for _, took in steps)
    assert out.token_ids == reference_greedy(model, prompt[:80], 6)


def test_adapters_and_hooks_run_the_modules(model, make_engine, reference_greedy, monkeypatch):
    """A LoRA adapter (a Linear subclass) and a forward hook on a block: decode steps run the modules, and
    the hook sees every step."""
    steps = _steps(monkeypatch)
    adapted = copy.deepcopy(model)
    apply_lora(adapted, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    make_engine(adapted).generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
    assert steps and not any(took for _, took in steps)
    steps.clear()
    calls = []
    handle = model.layers[0].mlp.register_forward_hook(lambda module, args, out: calls.append(out.shape[1]))
    try:
        out = make_engine(model).generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))[0]
    finally:
        handle.remove()
    assert steps and not any(took for _, took in steps)
    assert calls == [3, 1, 1, 1]  # the prompt, then each decode step
    assert out.token_ids == reference_greedy(model, [5, 6, 7], 4)


def test_changes_between_steps_of_one_engine_are_seen(model, make_engine, reference_greedy, monkeypatch):
    """The one-call layer keeps what it read of the module tree from step to step: on one engine, a hook
    registered after it took steps, then an adapter swapped in, are seen at the next step (the modules run,
    the hook fires on every step), and once both are gone it takes the steps again."""
    steps = _steps(monkeypatch)
    model = copy.deepcopy(model)
    engine = make_engine(model)
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.generate([[5, 6, 7]], params)
    assert steps and all(took for rows, took in steps if rows == 1)
    steps.clear()
    calls = []
    handle = model.layers[-1].self_attn.o_proj.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        out = engine.generate([[5, 6, 7]], params)[0]
    finally:
        handle.remove()
    assert steps and not any(took for _, took in steps) and len(calls) == 4
    assert out.token_ids == reference_greedy(model, [5, 6, 7], 4)
    steps.clear()
    plain = [block.self_attn.q_proj for block in model.layers]
    apply_lora(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    assert all(block.self_attn.q_proj is not q for block, q in zip(model.layers, plain))
    with torch.no_grad():
        for block in model.layers:  # a non-zero adapter: the module path's output differs from the base's
            block.self_attn.q_proj.lora_B.weight.normal_(0.0, 0.5)
    out = engine.generate([[5, 6, 7]], params)[0]
    assert steps and not any(took for _, took in steps)
    assert out.token_ids == reference_greedy(model, [5, 6, 7], 4)
    steps.clear()
    for block, q in zip(model.layers, plain):
        block.self_attn.q_proj = q
    engine.generate([[5, 6, 7]], params)
    assert steps and all(took for rows, took in steps if rows == 1)


class _ShiftedNorm(RMSNorm):
    """An RMSNorm that adds one: a norm of another kind than the one-call layer computes."""

    def forward(self, x):
        return super().forward(x) + 1.0


def test_blocks_swapped_in_a_running_engine_are_seen(model, make_engine, reference_greedy, monkeypatch):
    """A block replaced by a new one over the same children, with a pre-hook that changes its input, and a norm
    of another kind swapped into a block: the next steps run the modules and match them."""
    steps = _steps(monkeypatch)
    model = copy.deepcopy(model)
    engine = make_engine(model)
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.generate([[5, 6, 7]], params)
    old = model.layers[0]
    new = Block.__new__(Block)
    torch.nn.Module.__init__(new)
    for name, child in old._modules.items():
        new.add_module(name, child)
    new.register_forward_pre_hook(lambda module, args: (args[0] * 0.5, *args[1:]))
    model.layers[0] = new
    steps.clear()
    out = engine.generate([[5, 6, 7]], params)[0]
    assert steps and not any(took for _, took in steps)
    assert out.token_ids == reference_greedy(model, [5, 6, 7], 4)
    model.layers[0] = old
    shifted = _ShiftedNorm(model.config.hidden_size, old.post_attention_layernorm.eps)
    shifted.load_state_dict(old.post_attention_layernorm.state_dict())
    model.layers[1].post_attention_layernorm = shifted
    steps.clear()
    out = engine.generate([[5, 6, 7]], params)[0]
    assert steps and not any(took for _, took in steps)
    assert out.token_ids == reference_greedy(model, [5, 6, 7], 4)
