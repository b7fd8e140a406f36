import pytest

from astrai_pl.data.formats import encode_preference, encode_prompt, encode_row, infer_sections
from astrai_pl.data.preprocess import Section, preset_sections, render_example
from astrai_pl.model import ConfigError
from astrai_pl.tokenizer import Tokenizer, train_bpe

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 30 - 8?"},
    {"role": "assistant", "content": "22"},
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.byte_level()


def spans(tokenizer, text_parts):
    """Expected ids and mask from hand-listed (text, trained) pieces."""
    ids, mask = [], []
    for text, trained in text_parts:
        chunk = [text] if isinstance(text, int) else tokenizer.encode(text)
        ids += chunk
        mask += [int(trained)] * len(chunk)
    return ids, mask


def test_default_roles_mask_system_and_user_and_train_assistant_with_end_of_turn(tok):
    out = encode_row({"messages": CONVERSATION}, preset_sections("messages"), tok)
    ids, mask = spans(
        tok,
        [
            (tok.bos_token_id, False),
            ("<|im_start|>system\nBe brief.<|im_end|>\n", False),
            ("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n", False),
            ("<|im_start|>assistant\n", False),
            ("4<|im_end|>\n", True),
            ("<|im_start|>user\nAnd 30 - 8?<|im_end|>\n", False),
            ("<|im_start|>assistant\n", False),
            ("22<|im_end|>\n", True),
        ],
    )
    assert out["input_ids"] == ids
    assert out["loss_mask"] == mask
    im_end = tok.token_to_id("<|im_end|>")
    assert [m for t, m in zip(ids, mask) if t == im_end] == [0, 0, 1, 0, 1]
    assert render_example(out["input_ids"], out["loss_mask"], tok).endswith("assistant\n[[22<|im_end|>\n]]")


def test_custom_role_rules_train_user_turns_and_mask_assistant(tok):
    section = Section(
        "messages", template=True, roles={"system": "train", "user": "train", "assistant": "mask"}
    )
    out = encode_row({"messages": CONVERSATION[:3]}, [section], tok)
    ids, mask = spans(
        tok,
        [
            (tok.bos_token_id, False),
            ("<|im_start|>system\nBe brief.<|im_end|>\n", True),
            ("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n", True),
            ("<|im_start|>assistant\n4<|im_end|>\n", False),
        ],
    )
    assert (out["input_ids"], out["loss_mask"]) == (ids, mask)


def test_non_template_sections_and_no_mask_when_everything_trains(tok):
    out = encode_row({"prompt": "2+2=", "completion": "4"}, preset_sections("prompt_completion"), tok)
    assert out == {"input_ids": tok.encode("2+2=4") + [tok.eos_token_id], "loss_mask": [0, 0, 0, 0, 1, 1]}
    plain = encode_row({"text": "hello"}, preset_sections("text"), tok)
    assert plain == {"input_ids": tok.encode("hello")}
    both = encode_row({"a": "x", "b": "y"}, [Section("a"), Section("b")], tok)
    assert "loss_mask" not in both


def transformers_tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    texts = [
        "What is 2 + 2? The answer is 4. " * 3,
        "Be brief and answer the question, please.",
        "22 and 30 - 8",
    ]
    out = []
    for name, ours in (("byte", Tokenizer.byte_level()), ("bpe", train_bpe(texts * 20, vocab_size=330))):
        folder = tmp_path_factory.mktemp(name)
        ours.save_pretrained(folder)
        out.append((Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)))
    return out


def test_template_ids_equal_transformers_apply_chat_template_with_bos_prepended(tmp_path_factory):
    """transformers renders the whole conversation at once and adds no BOS for this template; we render
    each message alone and prepend BOS: the ids after our BOS must be exactly transformers' ids."""
    for ours, theirs in transformers_tokenizers(tmp_path_factory):
        out = encode_row({"messages": CONVERSATION}, preset_sections("messages"), ours)
        reference = theirs.apply_chat_template(CONVERSATION)
        reference = (
            reference["input_ids"] if isinstance(reference, dict) or hasattr(reference, "keys") else reference
        )
        assert out["input_ids"][0] == ours.bos_token_id
        assert out["input_ids"][1:] == list(reference)
        # mask as specified: trained = the characters of each assistant content plus its "<|im_end|>\n"
        text = theirs.apply_chat_template(CONVERSATION, tokenize=False)
        trained_chars, at = set(), 0
        for message in CONVERSATION:
            header = f"<|im_start|>{message['role']}\n"
            body = message["content"] + "<|im_end|>\n"
            at = text.index(header + body, at) + len(header)
            if message["role"] == "assistant":
                trained_chars.update(range(at, at + len(body)))
            at += len(body)
        offsets = theirs(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        assert out["loss_mask"][1:] == [int(start in trained_chars) for start, _ in offsets]


def test_string_values_in_template_sections_take_the_section_role(tok):
    out = encode_row({"prompt": "Hi?", "completion": "Yo"}, preset_sections("chat"), tok)
    expected = encode_row(
        {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yo"}]},
        preset_sections("messages"),
        tok,
    )
    assert out == expected


def test_preference_rows_share_the_prompt(tok):
    row = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "chosen": "2", "rejected": "3"}
    out = encode_preference(row, preset_sections("preference"), tok)
    n = out["prompt_length"]
    assert out["chosen_input_ids"][:n] == out["rejected_input_ids"][:n]
    assert out["chosen_input_ids"][n:] != out["rejected_input_ids"][n:]
    assert set(out["chosen_loss_mask"][:n]) == {0}
    chosen = render_example(out["chosen_input_ids"], out["chosen_loss_mask"], tok)
    assert chosen.endswith("<|im_start|>assistant\n[[2<|im_end|>\n]]")
    text = encode_preference(
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"}, preset_sections("preference_text"), tok
    )
    assert text["chosen_input_ids"] == tok.encode("1+1=2") + [tok.eos_token_id]
    assert text["rejected_loss_mask"] == [0, 0, 0, 0, 1, 1]


def test_grpo_prompt_ends_with_the_generation_prompt(tok):
    out = encode_prompt({"prompt": "What is 1 + 1?", "answer": "2"}, preset_sections("grpo"), tok)
    assert (
        tok.decode(out["prompt_ids"])
        == "<bos><|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out["prompt_ids"][1:] == tok.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 1?"}], add_generation_prompt=True
    )


def test_infer_sections_and_bad_section_configs():
    assert infer_sections({"messages": []})[0].template
    assert infer_sections({"prompt": "a", "completion": "b"})[1].eos
    assert infer_sections({"prompt": [], "chosen": [], "rejected": []}, "dpo")[0].template
    with pytest.raises(ConfigError, match="action='learn'"):
        Section("text", action="learn")
    with pytest.raises(ConfigError, match="role='bot'"):
        Section("prompt", template=True, role="bot")
    with pytest.raises(ConfigError, match="unknown sections preset"):
        preset_sections("nope")
