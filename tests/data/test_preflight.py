import pytest
from datasets import Dataset

from astrai_pl.data.formats import encode_row
from astrai_pl.data.preflight import (
    check_bos_once,
    check_special_tokens,
    check_tokenizer,
    check_trained_tokens,
    describe_example,
)
from astrai_pl.data.preprocess import Section, preset_sections
from astrai_pl.data.rows import DataError
from astrai_pl.tokenizer import CHATML_TEMPLATE, Tokenizer

MESSAGES = preset_sections("messages")


def byte_tokenizer(template=CHATML_TEMPLATE, drop=()):
    tok = Tokenizer.byte_level()
    tok.chat_template = template
    for key in drop:
        tok.special_tokens.pop(key)
    return tok


def test_a_sound_setup_passes():
    check_tokenizer(byte_tokenizer(), MESSAGES, vocab_size=320)
    check_tokenizer(byte_tokenizer(), preset_sections("prompt_completion"))
    check_tokenizer(byte_tokenizer(), preset_sections("preference"))
    check_tokenizer(byte_tokenizer(), preset_sections("text"))


def test_missing_special_tokens_or_template_or_vocabulary():
    with pytest.raises(DataError, match="field 'eos_token': the tokenizer has no eos_token"):
        check_special_tokens(byte_tokenizer(drop=("eos_token", "pad_token")), MESSAGES)
    with pytest.raises(DataError, match="has none"):
        check_tokenizer(byte_tokenizer(template=None), MESSAGES)
    with pytest.raises(DataError, match="vocab_size=4"):
        check_special_tokens(byte_tokenizer(), MESSAGES, vocab_size=4)


def test_template_that_does_not_render():
    broken = "{{ raise_exception('this template needs a tools list') }}"
    with pytest.raises(DataError, match="failed to render.*needs a tools list"):
        check_tokenizer(byte_tokenizer(broken), MESSAGES)


def test_template_that_depends_on_other_messages_renders_whole(caplog):
    """A default system prompt: one conversation is rendered whole and masked by prefixes (ids as the
    whole render, the assistant's answer trained); sections rendered one by one and joined are refused."""
    default_system = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "{% endif %}" + CHATML_TEMPLATE
    )
    tok = byte_tokenizer(default_system)
    with caplog.at_level("INFO"):
        check_tokenizer(tok, MESSAGES)
    assert "rendered whole and masked by prefix renders" in caplog.text
    messages = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]
    row = encode_row({"messages": messages}, MESSAGES, tok)
    assert row["input_ids"] == [tok.bos_token_id, *tok.apply_chat_template(messages)]
    assert describe_example([row], tok).endswith("You are helpful.<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?"
                                                 "<|im_end|>\n<|im_start|>assistant\n[[2<|im_end|>\n]]")
    with pytest.raises(DataError, match=r"field 'prompt': .*sections \['prompt', 'chosen', 'rejected'\] cannot"):
        check_tokenizer(tok, preset_sections("preference"))


def test_end_of_turn_must_be_trained():
    no_end_token = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(DataError, match="trained 'assistant' turn trains '42\\\\n\\\\n'.*end-of-generation"):
        check_tokenizer(byte_tokenizer(no_end_token), MESSAGES)
    without_eos = [Section("prompt", action="mask"), Section("completion")]
    with pytest.raises(DataError, match="field 'completion': a trained section ends without EOS"):
        check_tokenizer(byte_tokenizer(), without_eos)


def test_doubled_bos_is_caught_with_its_row():
    tok = byte_tokenizer()
    rows = Dataset.from_list([{"input_ids": [1, 40, 41]}, {"input_ids": [7]}, {"input_ids": [1, 1, 42]}])
    with pytest.raises(
        DataError, match="rows.jsonl, line 9, field 'input_ids': the row starts with BOS twice"
    ):
        check_bos_once(rows, tok, "rows.jsonl", lines=[2, 5, 9])
    check_bos_once(rows.select([0, 1]), tok, "rows.jsonl")


def test_rows_without_a_trained_token_after_truncation():
    tok = byte_tokenizer()
    long_question = {
        "messages": [{"role": "user", "content": "x" * 60}, {"role": "assistant", "content": "42"}]
    }
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "42"}]}
    rows = Dataset.from_list([encode_row(r, MESSAGES, tok) for r in (short, long_question, short)])
    with pytest.raises(
        DataError, match=r"data.jsonl, line 4, field 'loss_mask': no trained token left.*truncation=right"
    ):
        check_trained_tokens(rows, 64, "none", "right", source="data.jsonl", lines=[1, 4, 6])
    assert check_trained_tokens(rows, 64, "none", "left").tolist() == [0, 1, 2]
    assert check_trained_tokens(rows, 64, "bfd_split").tolist() == [0, 1, 2]
    assert check_trained_tokens(rows, 64, "bfd", "right", on_bad_row="skip").tolist() == [0, 2]
    user_only = encode_row({"messages": [{"role": "user", "content": "hi"}]}, MESSAGES, tok)
    with pytest.raises(DataError, match="row 1"):
        check_trained_tokens([user_only], 64)


def test_describe_example_marks_trained_tokens():
    tok = byte_tokenizer()
    row = {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]}
    text = describe_example([encode_row(row, MESSAGES, tok)], tok)
    assert text == "<bos><|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n[[2<|im_end|>\n]]"
