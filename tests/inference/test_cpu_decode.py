"""The one-call decode layer (inference/cpu_decode.py): the same logits as the module path, bit for bit, and
the module path wherever it does not apply."""

import dataclasses

import pytest
import torch

from astrai_pl.inference import SamplingParams
from astrai_pl.inference.cpu_decode import unsupported
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.ops import cpu as cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the fused CPU kernels do not build here")


def _prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 40, (count,), generator=g)]


def _counting(monkeypatch) -> list[int]:
    calls = []
    real = cpu_ops.decode_layer

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(cpu_ops, "decode_layer", counted)
    return calls


def _run(engine, prompts, fused: bool, **params):
    if not fused:
        engine.runner.cpu_decode = None
    return engine.generate(prompts, SamplingParams(temperature=0, ignore_eos=True, logprobs=True, top_logprobs=4,
                                                   **params))


def test_same_logprobs_as_the_module_path(model, make_engine, monkeypatch):
    """Greedy decoding of 12 ragged prompts with a shared prefix among them, a page size that splits contexts
    across pages, and a token budget that makes some steps mixed (those run the modules): every token, its
    log-probability and the top-4 alternatives equal the module path's exactly."""
    calls = _counting(monkeypatch)
    prompts = _prompts(model.config.vocab_size, 12)
    prompts += [prompts[0][:20] + p for p in _prompts(model.config.vocab_size, 4, seed=1)]
    fused = _run(make_engine(model, page_size=4, max_step_tokens=64), prompts, True, max_tokens=20)
    assert calls and all(n <= cpu_ops.PANEL_MAX_ROWS for n in calls)  # the one-call path ran
    assert len(calls) % model.config.num_hidden_layers == 0
    calls.clear()
    plain = _run(make_engine(model, page_size=4, max_step_tokens=64), prompts, False, max_tokens=20)
    assert not calls
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        assert list(a.logprobs) == list(b.logprobs)
        assert a.top_logprobs == b.top_logprobs


def test_greedy_equals_a_forward_without_cache(model, make_engine, reference_greedy):
    prompts = _prompts(model.config.vocab_size, 6, seed=2)
    outs = make_engine(model, page_size=8).generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                           ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(model, prompt, 12)


def test_more_rows_than_panels_take_the_module_path(model, make_engine, monkeypatch):
    """Above PANEL_MAX_ROWS decodes in a step the module path multiplies by the weights as stored, so the
    one-call path steps aside (its rows would be summed in another order)."""
    calls = _counting(monkeypatch)
    prompts = _prompts(model.config.vocab_size, cpu_ops.PANEL_MAX_ROWS + 6, seed=3)
    make_engine(model, max_total_tokens=8192).generate(prompts, SamplingParams(max_tokens=3, temperature=0,
                                                                               ignore_eos=True))
    assert all(n <= cpu_ops.PANEL_MAX_ROWS for n in calls)


def _debug(**changes) -> Transformer:
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(ModelConfig.from_name("debug"), **changes)).eval()


@pytest.mark.parametrize("changes", [dict(qk_norm=True), dict(sliding_window=4), dict(attn_logit_softcapping=30.0),
                                     dict(query_pre_attn_scalar=24),
                                     dict(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5})])
def test_other_blocks_are_refused(changes):
    assert unsupported(_debug(**changes)) is not None


def test_biased_projections_and_adapters_run_the_modules(make_engine, monkeypatch):
    """Qwen2's q/k/v biases: the layer has no bias, so the step runs the modules, and still decodes."""
    calls = _counting(monkeypatch)
    model = _debug(attention_bias=True)
    assert unsupported(model) is None  # the shape is fine; the biases are seen per step
    outs = make_engine(model).generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(outs[0].token_ids) == 4 and not calls
