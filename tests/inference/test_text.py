"""Streaming text: UTF-8 safe, never duplicated, stop strings cut and never streamed, stop ids left out."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.inference.text import TextStream
from astrai_pl.model import ModelConfig

tokenizers = pytest.importorskip("astrai_pl.tokenizer")
TEXT = "héllo 世界 🙂! naïve ✓"


@pytest.fixture(scope="module")
def tok():
    return tokenizers.Tokenizer.byte_level()


class ScriptedModel(nn.Module):
    """Greedy decoding yields `script` whatever the prompt: the logits depend only on the position."""

    def __init__(self, script: list[int], prompt_len: int):
        super().__init__()
        self.config = ModelConfig.from_name("debug")
        positions, vocab = self.config.max_position_embeddings, self.config.vocab_size
        self.lm_head = nn.Linear(positions, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.zero_()
            for i, token in enumerate(script):
                self.lm_head.weight[token, prompt_len - 1 + i] = 1.0

    def hidden_states(self, input_ids, position_ids=None, document_ids=None, cache=None):
        return F.one_hot(position_ids, self.config.max_position_embeddings).float(), None


def pushed(stream: TextStream, ids: list[int]) -> list[str]:
    deltas = [stream.push(i) for i in ids]
    return deltas + [stream.finish()]


def test_multibyte_characters_split_over_tokens_are_never_emitted_broken(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # one token per byte: several tokens per non-ASCII character
    deltas = pushed(TextStream(tok, []), ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) == len(TEXT)  # each character exactly once, as soon as complete


def test_stop_string_cuts_the_text_and_held_text_is_never_retracted(tok):
    stream = TextStream(tok, ["o 世", "zzz"])
    deltas, final = [], None
    for i in tok.encode(TEXT):
        deltas.append(stream.push(i))
        if stream.stopped:
            break
    final = stream.text
    deltas.append(stream.finish())
    assert final == "héll" and stream.stopped
    assert "".join(deltas) == final  # nothing streamed past the cut


def test_a_stop_string_prefix_that_does_not_complete_is_released(tok):
    stream = TextStream(tok, ["lo!"])
    deltas = pushed(stream, tok.encode("hello world"))
    assert "".join(deltas) == "hello world" and not stream.stopped
    assert deltas[3:6] == ["l", "", "lo "]  # "lo" might begin "lo!": held back, released with " "


def test_incomplete_bytes_at_the_end_are_flushed_as_replacement(tok):
    ids = tok.encode("ok 🙂")[:-2]
    deltas = pushed(TextStream(tok, []), ids)
    assert "".join(deltas[:-1]) == "ok " and deltas[-1] == "\ufffd"


def engine_for(tok, text: str, prompt_len: int = 3, extra: list[int] = ()) -> Engine:
    script = tok.encode(text) + list(extra)
    return Engine(ScriptedModel(script, prompt_len), tokenizer=tok, page_size=4, debug=True)


def test_engine_stream_is_utf8_safe_and_concatenates_to_the_completion(tok):
    engine = engine_for(tok, TEXT)
    params = SamplingParams(temperature=0, max_tokens=len(tok.encode(TEXT)))
    deltas = list(engine.stream([10, 11, 12], params))
    texts = [d.text for d in deltas]
    assert "".join(texts) == TEXT and all("\ufffd" not in t for t in texts)
    assert [t for d in deltas for t in d.token_ids] == tok.encode(TEXT)  # every id once, in order
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion.text == TEXT
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_engine_stop_string_and_end_of_sequence(tok):
    engine = engine_for(tok, TEXT)
    [out] = engine.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=64, stop=["世界"]))
    assert out.text == "héllo " and out.finish_reason == "stop"
    assert tok.decode(out.token_ids).startswith(
        "héllo 世界"
    )  # ids run up to the token that completed the stop
    streamed = list(engine_for(tok, TEXT).stream([10, 11, 12], SamplingParams(temperature=0, stop=["世界"])))
    assert "".join(d.text for d in streamed) == "héllo "
    engine = engine_for(tok, "bye", extra=[tok.eos_token_ids[0], 40, 41])
    [out] = engine.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=10))
    assert out.text == "bye" and out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_ids[0]
    [out] = engine_for(tok, "bye", extra=[tok.eos_token_ids[0], 40, 41]).generate(
        [[10, 11, 12]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_text_prompts_are_encoded_with_the_tokenizer(tok):
    prompt = "hi!"
    engine = engine_for(tok, "ok", prompt_len=len(tok.encode(prompt)))
    [out] = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2))
    assert out.text == "ok" and out.prompt_token_ids == tok.encode(prompt)


def test_abandoning_a_stream_aborts_its_request(tok):
    engine = engine_for(tok, TEXT)
    stream = engine.stream([10, 11, 12], SamplingParams(temperature=0, max_tokens=20))
    next(stream)
    stream.close()
    assert not engine.has_unfinished()
    assert engine.check().in_use == 0


@given(text=st.text(alphabet="abc", max_size=40), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6),
                                                                 min_size=1, max_size=3))
@settings(max_examples=300, deadline=None)
def test_held_back_text_is_the_longest_tail_that_starts_a_stop_string(tok, text, stops):
    """What a stream holds back, kept up as text arrives (each new character moves each stop's match once,
    whatever the stop strings' length), is the longest tail that is a proper prefix of a stop string."""
    stream = TextStream(tok, stops)
    for ch in text:
        stream.push(tok.encode(ch)[0])
        if stream.stopped:
            return
        longest = max((k for k in range(1, len(stream.text) + 1) for s in stops
                       if len(s) > k and s.startswith(stream.text[-k:])), default=0)
        assert stream._held_back() == longest
