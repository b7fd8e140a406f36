"""AstraiLM against lm-eval's own `hf` model on the same exported weights: the same log-likelihood per request,
the same greedy answers, the same task metrics on both shipped tasks."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance

from astrai_pl.evaluation import evaluate

LIMIT = 8
TOLERANCE = 1e-4
RELATIVE = 1e-6


@pytest.fixture(scope="module")
def peer(hf_dir, ours):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(hf_dir), device="cpu", batch_size=16, max_length=ours.max_length, dtype="float32")


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [
    ("What is 2 + 3?", " 5"),
    ("What is 2 + 3?", " 6"),
    ("What is 2 + 3?", " five, I think"),
    ("The list.sort() method", " sorts the list in place."),
    ("", "An empty context is scored after BOS."),
    ("Trailing spaces move to the continuation ", "so both tokenize alike."),
    ("x" * 600, " a context longer than the window keeps its end"),
]


def test_loglikelihoods_match_lm_eval_hf(ours, peer):
    requests = instances("loglikelihood", PAIRS)
    got, want = ours.loglikelihood(requests), peer.loglikelihood(requests)
    for (context, continuation), (logprob, greedy), (ref, ref_greedy) in zip(PAIRS, got, want):
        assert abs(logprob - ref) <= TOLERANCE, (context[:40], continuation, logprob, ref)
        assert greedy == ref_greedy


def test_greedy_flag_says_whether_every_token_is_the_likeliest(ours):
    from astrai_pl.inference import SamplingParams

    context = ours.tok_encode("What is")
    [out] = ours.engine.generate([context], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    other = [*out.token_ids[:-1], (out.token_ids[-1] + 1) % ours.tokenizer.vocab_size]
    [(best, greedy), (worse, not_greedy)] = ours._loglikelihood_tokens(
        [(None, context, out.token_ids), (None, context, other)])
    assert greedy and not not_greedy and best > worse


def test_rolling_loglikelihoods_match_lm_eval_hf(ours, peer):
    texts = [("A short text.",), ("word " * 300,)]  # the second spans several windows
    requests = instances("loglikelihood_rolling", texts)
    for got, want in zip(ours.loglikelihood_rolling(requests), peer.loglikelihood_rolling(requests)):
        assert abs(got - want) <= 10 * TOLERANCE, (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["astrai_arithmetic", "astrai_next_sentence"])
def test_shipped_task_metrics_match_lm_eval_hf(ours, peer, task):
    mine = evaluate(ours, [task], limit=LIMIT, log_samples=True)
    theirs = evaluate(peer, [task], limit=LIMIT, log_samples=True)
    assert mine["results"][task] == pytest.approx(theirs["results"][task])
    assert len(mine["samples"][task]) == len(theirs["samples"][task]) == LIMIT
    for a, b in zip(mine["samples"][task], theirs["samples"][task]):
        assert a["doc_id"] == b["doc_id"] and len(a["filtered_resps"]) == len(b["filtered_resps"])
        for got, want in zip(a["filtered_resps"], b["filtered_resps"]):  # a text, or (logprob, is_greedy)
            if isinstance(got, str):
                assert got == want
            else:  # sums over ~100 tokens: lm-eval's hf model adds them up in float32, hence the relative term
                assert got[0] == pytest.approx(want[0], rel=RELATIVE, abs=TOLERANCE) and got[1] == want[1]
