"""Every turn of `chat` shows the model exactly the ids that fine-tuning trained it on: the SFT row of the same
multi-turn conversation (messages preset) up to the answer, BOS once at the start, on the byte tokenizer, a
trained BPE tokenizer (whose re-encoded replies differ from the sampled ids) and a template that writes BOS."""

import itertools

import pytest
from test_commands import _chatty_model

from astrai_pl.commands import Conversation, chat_ids
from astrai_pl.data.formats import encode_row
from astrai_pl.data.preprocess import preset_sections
from astrai_pl.inference import Engine, SamplingParams, Session
from astrai_pl.tokenizer import Tokenizer, train_bpe

TURNS = ["What is 3 + 4?", "And 7 - 12?", " What is  10 + 2 ?"]


def bpe() -> Tokenizer:
    words = ["".join(w) for w in itertools.product("0123456789 +-?", repeat=2)]
    return train_bpe([f"What is {w}? And {w} - {w}" for w in words] * 3, 300, min_frequency=1)


def bos_in_template() -> Tokenizer:
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template  # as a model export may write it
    return tokenizer


def trained_starts(mask: list[int]) -> list[int]:
    """Where each trained span (an assistant answer) begins."""
    return [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


@pytest.fixture(scope="module")
def model():
    return _chatty_model()


@pytest.mark.parametrize("make", [Tokenizer.byte_level, bpe, bos_in_template])
@pytest.mark.parametrize("system", [None, "You answer arithmetic questions."])
def test_each_turn_sees_the_sft_rows_ids_up_to_its_answer(model, make, system, monkeypatch):
    tokenizer = make()
    assert tokenizer.vocab_size <= model.config.vocab_size
    prompts = []  # the whole conversation each turn runs on: the session's tokens and the ids it appends
    stream = Session.stream
    monkeypatch.setattr(Session, "stream", lambda s, ids, params: prompts.append([*s.tokens, *ids]) or
                        stream(s, ids, params))
    engine = Engine(model, tokenizer, max_total_tokens=4096, debug=True)
    chat = Conversation(engine, tokenizer, SamplingParams(max_tokens=6, temperature=0), system)
    replies = ["".join(chat.reply(text)) for text in TURNS]
    chat.close()
    engine.check()

    row = encode_row({"messages": chat.messages}, preset_sections("messages"), tokenizer)
    ids, starts = row["input_ids"], trained_starts(row["loss_mask"])
    assert len(starts) == len(TURNS) and ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    first_user = 1 if system else 0
    for turn, (prompt, start) in enumerate(zip(prompts, starts)):
        assert prompt == ids[:start], f"turn {turn + 1}: {tokenizer.decode(prompt)!r} vs {tokenizer.decode(ids[:start])!r}"
        assert prompt == chat_ids(tokenizer, chat.messages[: first_user + 2 * turn + 1])
    assert [m["content"] for m in chat.messages if m["role"] == "assistant"] == replies


def test_a_reply_is_the_greedy_continuation_of_its_sft_prefix(model):
    """The second answer equals one greedy generation on the SFT prefix: the session's kept K/V change nothing."""
    tokenizer = bpe()
    engine = Engine(model, tokenizer, max_total_tokens=4096, debug=True)
    chat = Conversation(engine, tokenizer, SamplingParams(max_tokens=6, temperature=0))
    for text in TURNS[:2]:
        reply = "".join(chat.reply(text))
    chat.close()
    row = encode_row({"messages": chat.messages}, preset_sections("messages"), tokenizer)
    prefix = row["input_ids"][: trained_starts(row["loss_mask"])[1]]
    [fresh] = Engine(model, tokenizer, max_total_tokens=4096).generate([prefix], SamplingParams(max_tokens=6,
                                                                                               temperature=0))
    assert reply == fresh.text and prefix[0] == tokenizer.bos_token_id


def test_ctrl_d_at_the_prompt_ends_the_line():
    import io

    from astrai_pl.commands import _chat_loop

    for typed, expected in (("", "> \n"), ("/exit\n", "> ")):  # Ctrl-D echoes nothing; /exit echoed its own newline
        out = io.StringIO()
        _chat_loop(conversation=None, stdin=io.StringIO(typed), stdout=out, interactive=True)
        assert out.getvalue() == expected
