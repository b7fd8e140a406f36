"""N-gram speculative decoding: greedy output equal to plain decoding (tokens, log-probs, ends), rejected drafts'
memory rolled back, and the sampled output distribution equal to the plain sampler's."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from astrai_pl.inference import Engine, EngineConfigError, RequestError, SamplingParams, SpeculativeConfig
from astrai_pl.inference.request import Request
from astrai_pl.inference.sampling import sample
from astrai_pl.inference.speculative import propose_ngram, target_probs, verify_drafts
from astrai_pl.model import ModelConfig, Transformer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_speculative import copying_model  # noqa: E402

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def copier():
    """Follows a cycle over the vocabulary most of the time, attention sometimes steering it off: drafts taken
    from a quoted stretch of the cycle are often accepted and sometimes rejected."""
    return copying_model(ModelConfig.from_name("debug"), mix=0.25)


def quoting_prompts(cycle, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        start = int(torch.randint(0, len(cycle) - n, (1,), generator=g))
        out.append(cycle[start : start + n] + cycle[start : start + 2])
    return out


def test_ngram_proposal_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    assert propose_ngram([5, 6, 5, 6], 3, 2, 2) == [5, 6]  # the continuation may run into the suffix itself
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []
    assert propose_ngram([8, 1, 4, 8], 3, 2, 3) == []  # only a 1-gram matches, below prompt_lookup_min
    assert propose_ngram([8, 1, 4, 8], 3, 1, 3) == [1, 4, 8]


def test_config_is_checked_and_read_from_vllm_json(model):
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 2)
    for bad, words in [('{"method": "eagle"}', "ngram"), ('{"num_speculative_tokens": 0}', ">= 1"),
                       ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "exceeds"),
                       ('{"draft": 1}', "unknown key"), ("[1]", "JSON object"), ("{nope", "not JSON")]:
        with pytest.raises(EngineConfigError, match=words):
            SpeculativeConfig.from_json(bad)
    rwkv = Transformer(ModelConfig.from_name("rwkv-debug"))
    with pytest.raises(EngineConfigError, match="recurrent"):
        Engine(rwkv, max_total_tokens=1024, speculative=SPEC)


def _both(model, prompts, params, **kwargs):
    plain = Engine(model, debug=True, max_total_tokens=4096, **kwargs)
    spec = Engine(model, debug=True, max_total_tokens=4096, speculative=SPEC, **kwargs)
    return plain, spec, plain.generate(prompts, params), spec.generate(prompts, params)


def _same(a, b):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


@pytest.mark.parametrize("page_size", [4, 16])
def test_greedy_output_is_the_plain_output(copier, model, page_size, random_prompts):
    copying, cycle = copier
    lengths = [6, 11, 17, 23, 30]
    prompts = quoting_prompts(cycle, lengths)
    max_tokens = [1, 2, 5, 24, 40]
    params = [SamplingParams(max_tokens=m, temperature=0, logprobs=True, ignore_eos=True) for m in max_tokens]
    plain, spec, a, b = _both(copying, prompts, params, page_size=page_size)
    _same(a, b)
    assert [len(c.token_ids) for c in b] == max_tokens  # never past max_tokens
    stats = spec.stats
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens  # both accepted and rejected drafts were seen
    assert stats.steps < plain.stats.steps
    for prompt in prompts[3:]:  # one at a time (batch 1) too
        _same(plain.generate([prompt], params[-1]), spec.generate([prompt], params[-1]))
    repeating = [p * 3 for p in random_prompts([5, 8, 12], seed=3)]  # a random model: drafts rejected
    _, spec2, a, b = _both(model, repeating, SamplingParams(max_tokens=30, temperature=0, logprobs=True),
                           page_size=page_size)
    _same(a, b)
    assert spec2.stats.draft_tokens > spec2.stats.accepted_draft_tokens


def test_stops_inside_accepted_drafts_end_exactly(copier):
    copying, cycle = copier
    prompts = quoting_prompts(cycle, [20, 26], seed=4)
    free = Engine(copying, max_total_tokens=4096).generate(prompts, SamplingParams(max_tokens=30, temperature=0))
    params = [SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[c.token_ids[k]])
              for c, k in zip(free, (6, 13))]
    _, spec, a, b = _both(copying, prompts, params, page_size=4)
    _same(a, b)
    assert [len(c.token_ids) for c in b] == [7, 14] and {c.finish_reason for c in b} == {"stop"}
    assert spec.stats.accepted_draft_tokens > 0


def test_stop_strings_end_exactly(copier):
    tokenizer = pytest.importorskip("astrai_pl.tokenizer").Tokenizer.byte_level()
    copying, cycle = copier
    prompts = quoting_prompts([t for t in cycle if 32 <= t < 127], [24], seed=2)
    free = Engine(copying, tokenizer, max_total_tokens=4096).generate(
        prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = free.text[9:11]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    plain = Engine(copying, tokenizer, max_total_tokens=4096, debug=True)
    spec = Engine(copying, tokenizer, max_total_tokens=4096, debug=True, speculative=SPEC)
    a, b = plain.generate(prompts, params)[0], spec.generate(prompts, params)[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason) == (
        free.text[: free.text.index(stop)], a.token_ids, "stop")
    streamed = list(spec.stream(prompts[0], params))
    assert "".join(d.text for d in streamed) == a.text and streamed[-1].finish_reason == "stop"


def test_prefix_cache_never_holds_rejected_drafts(copier):
    """Continuations of earlier outputs start from the radix cache the speculative engine filled; they must
    decode as a plain engine without a cache does."""
    copying, cycle = copier
    prompts = quoting_prompts(cycle, [18, 25, 31], seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=True)
    spec = Engine(copying, debug=True, max_total_tokens=4096, page_size=4, speculative=SPEC)
    first = spec.generate(prompts, params)
    more = [p + c.token_ids[:k] for p, c in zip(prompts, first) for k in (5, 17)]
    cached_before = spec.stats.cached_tokens
    again = spec.generate(more, params)
    assert spec.stats.cached_tokens > cached_before
    plain = Engine(copying, debug=True, max_total_tokens=4096, page_size=4, prefix_cache=False)
    _same(plain.generate(more, params), again)
    assert spec.stats.draft_tokens > spec.stats.accepted_draft_tokens > 0


def test_sampled_requests_run_and_are_reproducible_with_a_seed(copier):
    copying, cycle = copier
    prompts = quoting_prompts(cycle, [20, 12], seed=5)
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=50, repetition_penalty=1.1, seed=3,
                            logprobs=True, top_logprobs=2)
    spec = Engine(copying, debug=True, max_total_tokens=4096, speculative=SPEC)
    a, b = spec.generate(prompts, params), spec.generate(prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert all(len(c.token_ids) == len(c.logprobs) == len(c.top_logprobs) == 20 for c in a)
    assert spec.stats.accepted_draft_tokens > 0


# -- the rejection scheme keeps the target distribution -------------------------------------------------------
V, DRAWS = 6, 12000


def _rows(params, context, drafts, logits_rows):
    """DRAWS requests with the same context and target rows, request i with draft drafts[i % len(drafts)],
    verified in one call; their outcomes, grouped by draft."""
    reqs = []
    for i in range(DRAWS):  # what verification reads of a request; one output token so far
        reqs.append(SimpleNamespace(tokens=context + context[-1:], num_prompt=len(context), params=params,
                                    seed=None, draft=list(drafts[i % len(drafts)])))
    k = len(drafts[0])
    assert all(len(d) == k for d in drafts)
    logits = torch.stack(logits_rows[: k + 1]).repeat(DRAWS, 1)  # (DRAWS * (k + 1), V)
    out = verify_drafts(logits, reqs)
    return [out[g :: len(drafts)] for g in range(len(drafts))]


def _within(counts: torch.Tensor, p: torch.Tensor, n: int) -> None:
    """Every frequency within 5 standard deviations of its probability (a chance miss: below 1e-5 per test)."""
    freq = counts.double() / n
    bound = 5 * (p * (1 - p) / n).sqrt() + 1e-9
    assert ((freq - p).abs() <= bound).all(), (freq.tolist(), p.tolist())


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, repetition_penalty=1.3),
                                   dict(temperature=1.3, top_p=0.8, presence_penalty=0.5)])
def test_the_first_token_has_the_plain_samplers_distribution(knobs):
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=8, **knobs)
    context = [1, 3, 3]
    rows = [torch.tensor([0.5, 1.0, -0.3, 2.0, 0.1, 0.9]), torch.tensor([1.5, -1.0, 0.3, 0.2, 0.0, 0.4])]
    p = target_probs(rows[0][None], [params], [context + [3]], [1])[0]
    for group in _rows(params, context, ([3], [5], [2]), rows):  # likely, middling and (under top-k) excluded
        _within(torch.bincount(torch.tensor([v.tokens[0] for v in group]), minlength=V), p, len(group))
    # the plain sampler's own draws, as a check on p itself
    plain, _, _ = sample(rows[0][None].repeat(DRAWS, 1), [params] * DRAWS, [context + [3]] * DRAWS,
                         [1] * DRAWS, [None] * DRAWS)
    _within(torch.bincount(torch.tensor(plain), minlength=V), p, DRAWS)


def test_the_token_after_an_accepted_draft_follows_its_own_row():
    torch.manual_seed(1)
    params = SamplingParams(max_tokens=8, temperature=0.9, frequency_penalty=0.4)
    context = [4, 0]
    rows = [torch.tensor([0.2, 0.1, 1.4, -0.5, 0.7, 0.0]), torch.tensor([-0.4, 1.2, 0.3, 0.9, 0.0, 0.6])]
    [out] = _rows(params, context, ([2],), rows)
    seconds = torch.tensor([v.tokens[1] for v in out if v.tokens[0] == 2])
    p = target_probs(rows[1][None], [params], [context + [0, 2]], [2])[0]  # its context holds the draft
    _within(torch.bincount(seconds, minlength=V), p, len(seconds))
    assert len(seconds) > DRAWS // 3


def test_greedy_verification_is_the_argmax_chain():
    params = SamplingParams(max_tokens=8, temperature=0)
    rows = [torch.tensor([0.0, 3.0, 1.0]), torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 5.0])]
    req = Request("g", [1, 1], params, None)
    req.tokens.append(1)
    req.draft = [1, 2]  # 1 is the argmax of row 0; 2 is not row 1's (0 is)
    [v] = verify_drafts(torch.stack(rows), [req])
    assert v.tokens == [1, 0]


def test_a_failing_verification_is_retried_alone_or_fails_only_its_request(copier, monkeypatch):
    from astrai_pl.inference import speculative

    copying, cycle = copier
    prompts = quoting_prompts(cycle, [16, 22], seed=9)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=True)
    plain = Engine(copying, debug=True, max_total_tokens=4096, page_size=4).generate(prompts, params)
    real, calls = speculative.verify_drafts, []

    def flaky(logits, reqs):
        calls.append(len(reqs))
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(logits, reqs)

    monkeypatch.setattr(speculative, "verify_drafts", flaky)
    spec = Engine(copying, debug=True, max_total_tokens=4096, page_size=4, speculative=SPEC)
    _same(plain, spec.generate(prompts, params))  # the failed step was run again, one request at a time
    assert len(calls) > 1

    def broken(logits, reqs):
        raise RuntimeError("always")

    monkeypatch.setattr(speculative, "verify_drafts", broken)
    with pytest.raises(RequestError, match="always"):  # each drafted request fails alone, the accounting holds
        spec.generate(prompts, params)
    assert spec.check() and not spec.scheduler.running
    monkeypatch.setattr(speculative, "verify_drafts", real)
    _same(plain, spec.generate(prompts, params))  # the pool and the radix cache are sound after the failures


def test_a_constrained_request_decodes_without_drafts(copier):
    copying, cycle = copier
    prompts = quoting_prompts(cycle, [20, 26], seed=4)
    plain = SamplingParams(max_tokens=20, temperature=0)
    biased = SamplingParams(max_tokens=20, temperature=0, logit_bias={int(cycle[0]): 0.0})  # changes no logit
    _, spec, a, b = _both(copying, prompts, biased, page_size=4)
    _same(a, b)
    assert spec.stats.draft_tokens == 0  # a constraint's masks and bias are not applied at drafted positions
    _, spec, _, _ = _both(copying, prompts, plain, page_size=4)
    assert spec.stats.draft_tokens > 0  # the same prompts unconstrained are drafted
