"""Constraints in the batched sampler, without the server: rows without one untouched, each request's grammar
state its own, refusals naming the field."""

import json

import pytest
import torch

from astrai_pl.inference import Engine, SamplingParams, SamplingParamsError, StructuredOutput
from astrai_pl.inference.constraints import RowConstraint, constrain
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import BYTE_OFFSET, Tokenizer


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return Engine(Transformer(ModelConfig.from_name("debug")).eval(), Tokenizer.byte_level())


def test_rows_without_a_constraint_keep_their_logits_exactly():
    logits = torch.randn(3, 50)
    rows = [None, RowConstraint(bias={4: 2.5}, bad_words=[(7,)]), None]
    out = constrain(logits.clone(), rows, [[1, 2], [1, 2], [1]], [1, 1, 0])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1, 4] == logits[1, 4] + 2.5 and out[1, 7] == float("-inf")
    assert torch.equal(out[1, :4], logits[1, :4])


def test_min_tokens_yields_when_nothing_else_is_left():
    logits = torch.zeros(2, 6)
    only_end = [(t,) for t in range(6) if t != 2]  # the harder mask leaves nothing but the end id
    rows = [RowConstraint(min_tokens=3, end_ids=(2,), bad_words=only_end), RowConstraint(min_tokens=3, end_ids=(2,))]
    out = constrain(logits.clone(), rows, [[1], [1]], [0, 0])
    assert out[0, 2] == 0.0 and out[0].isfinite().sum() == 1  # min_tokens yields rather than empty the row
    assert out[1, 2] == float("-inf") and out[1].isfinite().sum() == 5


def test_xgrammars_cpu_kernel_equals_the_unpacked_mask():
    from astrai_pl.inference.constraints import apply_bitmask
    from astrai_pl.inference.grammar import unpack_bitmask

    gen = torch.Generator().manual_seed(0)
    V = 100  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, V, generator=gen)
    rows = [0, 2, 3]
    reference = logits.clone()
    reference[rows] = reference[rows].masked_fill(~unpack_bitmask(bitmask[rows], V), float("-inf"))
    fused = logits.clone()
    apply_bitmask(fused, bitmask, rows)
    assert torch.equal(fused, reference) and torch.equal(fused[1], logits[1])
    assert 0 < reference.isinf().sum() < 3 * V


def test_engine_generate_follows_a_schema_for_every_sample(engine):
    schema = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "w": {"enum": ["x", "y"]}}, "required": ["v", "w"]}
    params = SamplingParams(max_tokens=60, n=8, seed=11, structured=StructuredOutput(json=schema))
    [first] = engine.generate(["a"], params)[:1]
    outs = engine.generate(["a", "b"], params)
    assert len(outs) == 16 and outs[0].text == first.text
    for out in outs:
        value = json.loads(out.text)
        assert 0 <= value["v"] <= 9 and value["w"] in ("x", "y")


def test_a_grammar_state_follows_the_request_tokens(engine):
    from astrai_pl.inference.grammar import GrammarState, bitmask_words, compile_structured, unpack_bitmask

    tok = engine.tokenizer
    compiled = compile_structured(StructuredOutput(choice=("ab", "ac")), tok, 320, [2])
    state = GrammarState(compiled)
    ids = tok.encode("ab")
    state.sync(ids)
    mask = torch.zeros(1, bitmask_words(320), dtype=torch.int32)
    assert state.fill(mask, 0) and unpack_bitmask(mask, 320)[0].nonzero().flatten().tolist() == [2]  # "ab": end
    state.sync(ids[:1])  # taken back to "a": rolled back, then "c" fits
    assert state.taken == 1 and state.matcher.accept_token(BYTE_OFFSET + ord("c"))


@pytest.mark.parametrize(("fields", "name"), [
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"bad_words": [3]}, "bad_words"),
    ({"structured": {"json": {}}}, "structured"),
    ({"structured": StructuredOutput(regex="a"), "ignore_eos": True}, "structured"),
])
def test_bad_values_are_refused_naming_the_field(fields, name):
    with pytest.raises(SamplingParamsError, match=f"SamplingParams.{name}"):
        SamplingParams(**fields)


def test_a_structured_output_needs_exactly_one_kind():
    from astrai_pl.inference import GrammarError

    with pytest.raises(GrammarError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))


def test_a_state_session_turn_follows_its_regex_and_bias():
    from astrai_pl.inference import StateSession

    torch.manual_seed(0)
    rwkv = Transformer(ModelConfig.from_name("rwkv-debug")).eval()
    tok = Tokenizer.byte_level()
    chat = StateSession(rwkv, tok)
    out = chat.generate("x", SamplingParams(max_tokens=20, seed=3, structured=StructuredOutput(regex="[0-9]{2,4}")))
    assert out.text.isdigit() and 2 <= len(out.text) <= 4
    forced = chat.generate("y", SamplingParams(max_tokens=5, logit_bias={BYTE_OFFSET + ord("z"): 100}))
    assert forced.text == "zzzzz"
