"""Random SamplingParams and random prompts (ids in and out of range, empty, huge, of any type) never wedge
the engine: each call returns or raises a typed error, and afterwards the books balance and a normal
request decodes exactly as before."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astrai_pl.inference import InferenceError, SamplingParams, SamplingParamsError
from astrai_pl.tokenizer import Tokenizer

VOCAB = 320  # the debug preset
NORMAL = [9, 40, 77, 12, 5]
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-3, 400), max_size=3),
)
ids = st.integers(0, VOCAB - 1)
VALID = {  # values of the right type, in range or at its edges
    "max_tokens": st.one_of(st.integers(0, 6), st.integers(10**6, 10**30)),
    "temperature": st.one_of(st.floats(0, 3), st.sampled_from([0.0, 1e-40, 1e-30, 1e30])),
    "top_k": st.one_of(st.integers(0, 400), st.integers(2**62, 2**80)),
    "top_p": st.floats(0, 1, exclude_min=True),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(1e-45, 1e30),
    "frequency_penalty": st.floats(-1e38, 1e38),
    "presence_penalty": st.floats(-1e38, 1e38),
    "stop": st.one_of(st.text(min_size=1, max_size=2), st.lists(st.text(min_size=1, max_size=2), max_size=2)),
    "stop_token_ids": st.lists(ids, max_size=3),
    "ignore_eos": st.booleans(),
    "n": st.one_of(st.integers(1, 3), st.integers(4, 10**6)),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 4)),
    "logprobs": st.booleans(),
}


@st.composite
def sampling_kwargs(draw) -> dict:
    """Some fields set to values of the right type; one time in four, one field set to anything."""
    kwargs = draw(st.fixed_dictionaries({}, optional=VALID))
    if draw(st.integers(0, 3)) == 0:
        kwargs[draw(st.sampled_from(sorted(VALID)))] = draw(anything)
    return kwargs


prompts = st.one_of(
    st.lists(ids, max_size=12),  # in range, maybe empty
    st.lists(ids, min_size=1, max_size=20),
    st.text(max_size=6),  # through the tokenizer
    st.lists(st.integers(-(2**70), 2**70), min_size=1, max_size=6),  # mostly out of range
    st.builds(lambda n, t: [t] * n, st.integers(20, 3000), st.integers(-1, VOCAB)),  # huge
    st.lists(
        st.one_of(ids, st.floats(), st.booleans(), st.text(max_size=2), st.none()), min_size=1, max_size=4
    ),
    anything,
)


def call(engine, kind, prompt, kwargs):
    params = SamplingParams(**kwargs)
    if kind == "generate":
        outs = engine.generate([prompt], params)
    elif kind == "with_a_normal_prompt":
        outs = engine.generate([prompt, NORMAL], params)
    else:
        outs = [d.completion for d in engine.stream(prompt, params) if d.completion is not None]
    for out in outs:
        assert all(0 <= t < VOCAB for t in out.token_ids)
        assert out.logprobs is None or all(not math.isnan(lp) for lp in out.logprobs)


def test_random_requests_never_wedge_the_engine(model, make_engine):
    engine = make_engine(
        model, tokenizer=Tokenizer.byte_level(), page_size=4, max_total_tokens=32, max_batch_size=4
    )
    [baseline] = engine.generate([NORMAL], GREEDY)

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        kind=st.sampled_from(["generate", "with_a_normal_prompt", "stream"]),
        prompt=prompts,
        kwargs=sampling_kwargs(),
    )
    def run(kind, prompt, kwargs):
        try:
            call(engine, kind, prompt, kwargs)
        except (SamplingParamsError, InferenceError):
            pass
        assert not engine.has_unfinished()
        engine.check()
        [again] = engine.generate([NORMAL], GREEDY)
        assert again.token_ids == baseline.token_ids
        assert engine.check().in_use == 0

    run()
