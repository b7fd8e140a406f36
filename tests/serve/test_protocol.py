"""Pieces of the OpenAI protocol that need no server: token bytes, field paths, refusals named by field."""

import json
import math

from astrai_pl.inference import SamplingParams, SamplingParamsError
from astrai_pl.serve.errors import field_path, from_sampling_error
from astrai_pl.serve.protocol import LOGPROB_FLOOR, generated_logprobs, token_bytes
from astrai_pl.tokenizer import BYTE_OFFSET


def test_a_token_holding_part_of_a_character_gives_that_byte(tokenizer):
    [first, second, third] = tokenizer.encode("€")  # three UTF-8 bytes, one token each
    assert [token_bytes(tokenizer, t) for t in (first, second, third)] == [b"\xe2", b"\x82", b"\xac"]
    assert token_bytes(tokenizer, BYTE_OFFSET + ord("a")) == b"a"
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token.encode()


def test_field_paths_read_like_the_request():
    assert field_path(("body", "messages", 0, "content", 2)) == "messages[0].content[2]"
    assert field_path(("body",)) is None


def test_a_sampling_refusal_names_the_request_field():
    try:
        SamplingParams(top_logprobs=25)
    except SamplingParamsError as err:
        refusal = from_sampling_error(err, {"top_logprobs": "logprobs"})
    assert (refusal.status, refusal.param) == (400, "logprobs")
    assert refusal.message.startswith("logprobs=25: ")


def test_a_logprob_of_minus_infinity_is_reported_as_openais_floor():
    entries = generated_logprobs([5, 6], [-math.inf, -1.0], [[(5, -math.inf)], [(6, -1.0)]])
    assert entries.logprobs == [LOGPROB_FLOOR, -1.0]
    assert entries.alternatives == [[(5, LOGPROB_FLOOR)], [(6, -1.0)]]
    json.dumps(entries.logprobs, allow_nan=False)  # valid JSON
