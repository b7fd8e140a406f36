"""Tokenizer: byte round-trips, fixed special ids, and parity with transformers on the same files."""

import json

import jinja2
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from astrai_pl.tokenizer import BYTE_OFFSET, Tokenizer, TokenizerError, train_bpe

transformers = pytest.importorskip("transformers")

TEXTS = [
    "plain ascii, with punctuation!",
    "héllo wörld — naïve café",
    "中文字符和日本語のテキスト",
    "emoji 🙂👍🏽 and flags 🇫🇷, zero-width\u200bjoiner",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there! 你好"},
    {"role": "assistant", "content": "Hello. 🙂"},
    {"role": "user", "content": "Count to three."},
]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a journey of a thousand miles begins with a single step",
    "to be or not to be, that is the question",
    "all that glitters is not gold; 金子总会发光",
] * 20

LLAMA_STYLE_TEMPLATE = """{{ bos_token }}
{% if tools %}
<|start_header_id|>system<|end_header_id|>

Tools: {{ tools | tojson(indent=2) }}<|eot_id|>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% endif %}"""

QWEN_STYLE_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\nDefault system.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def _hand_built_dir(folder, specials, config, template_file=None):
    """A folder as a Hub model ships it: a BPE tokenizer.json trained here plus a tokenizer_config.json."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS + [m["content"] for m in CHAT], trainer=trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if config.get("bos_token"):
        bos = config["bos_token"]["content"] if isinstance(config["bos_token"], dict) else config["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config})
    )
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file)
    return folder


@pytest.fixture
def llama_dir(tmp_path):
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    config = {
        "bos_token": {
            "__type": "AddedToken",
            "content": "<|begin_of_text|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "eos_token": "<|end_of_text|>",
        "chat_template": LLAMA_STYLE_TEMPLATE,
        "model_max_length": 8192,
    }
    return _hand_built_dir(tmp_path / "llama", specials, config)


@pytest.fixture
def qwen_dir(tmp_path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": "{{ 'overridden by chat_template.jinja' }}",
    }
    return _hand_built_dir(tmp_path / "qwen", specials, config, template_file=QWEN_STYLE_TEMPLATE)


def _hf_chat_ids(hf, messages, **kwargs):
    return hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


# --- byte tokenizer


def test_byte_level_round_trips_unicode_byte_by_byte():
    tok = Tokenizer.byte_level()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [BYTE_OFFSET + b for b in text.encode("utf-8")]
        assert tok.decode(ids) == text


def test_byte_level_special_ids():
    tok = Tokenizer.byte_level()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")
    assert [tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>")] == [3, 4]
    assert BYTE_OFFSET == 8 and tok.token_to_id("<|reserved_7|>") == 7
    assert tok.eos_token_ids == [2, 4]
    assert 256 < tok.vocab_size <= 320 and len(tok) == tok.vocab_size
    assert tok.id_to_token(BYTE_OFFSET + ord("a")) == "a"
    assert tok.encode("<|im_start|>a<eos>") == [3, BYTE_OFFSET + ord("a"), 2]
    assert tok.encode("a", add_special_tokens=True) == [1, BYTE_OFFSET + ord("a")]
    assert tok.decode([1, BYTE_OFFSET + ord("a"), 2], skip_special_tokens=True) == "a"


def test_byte_level_saves_for_transformers(tmp_path):
    tok = Tokenizer.byte_level()
    tok.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in tmp_path.iterdir())
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    reloaded = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        for add in (False, True):
            ids = tok.encode(text, add_special_tokens=add)
            assert hf(text, add_special_tokens=add)["input_ids"] == ids
            assert reloaded.encode(text, add_special_tokens=add) == ids
        assert hf.decode(tok.encode(text)) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)
    assert reloaded.chat_template == tok.chat_template and reloaded.eos_token_ids == [2, 4]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_byte_level_chat_matches_transformers(tmp_path, add_generation_prompt):
    tok = Tokenizer.byte_level()
    tok.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    assert ids == _hf_chat_ids(hf, CHAT, add_generation_prompt=add_generation_prompt)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert ids[0] == 3 and ids.count(4) == len(CHAT)


# --- hand-built Hub-style folders


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_llama_style_chat_matches_transformers(llama_dir, add_generation_prompt):
    tok = Tokenizer.from_pretrained(llama_dir)
    hf = transformers.AutoTokenizer.from_pretrained(llama_dir)
    tools = [{"name": "weather", "description": "Météo à Paris", "parameters": {"city": "string"}}]
    for extra in ({}, {"tools": tools}):
        ids = tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt, **extra)
        assert ids == _hf_chat_ids(hf, CHAT, add_generation_prompt=add_generation_prompt, **extra)
        text = tok.apply_chat_template(
            CHAT, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
        assert text == hf.apply_chat_template(
            CHAT, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    assert ids[0] == tok.bos_token_id == hf.bos_token_id
    assert tok.model_max_length == 8192
    assert tok.eos_token_ids == [tok.eos_token_id, tok.token_to_id("<|eot_id|>")]
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=True) == hf(text)["input_ids"]


def test_llama_style_raise_exception_matches_transformers(llama_dir):
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role robot"):
        Tokenizer.from_pretrained(llama_dir).apply_chat_template(bad)
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role robot"):
        transformers.AutoTokenizer.from_pretrained(llama_dir).apply_chat_template(bad)


@pytest.mark.parametrize(
    "kwargs", [{}, {"add_generation_prompt": True}, {"add_generation_prompt": True, "enable_thinking": False}]
)
def test_qwen_style_chat_template_file_matches_transformers(qwen_dir, kwargs):
    tok = Tokenizer.from_pretrained(qwen_dir)
    hf = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    no_system = CHAT[1:]
    assert tok.apply_chat_template(no_system, **kwargs) == _hf_chat_ids(hf, no_system, **kwargs)
    assert tok.chat_template == hf.chat_template
    assert tok.bos_token_id is None and tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert set(tok.eos_token_ids) == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}


@pytest.mark.parametrize("flags", [{"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}])
def test_add_bos_eos_flags_defer_to_tokenizer_json_like_transformers(llama_dir, flags):
    config_file = llama_dir / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **flags}))
    tok = Tokenizer.from_pretrained(llama_dir)
    hf = transformers.AutoTokenizer.from_pretrained(llama_dir)
    for text in TEXTS[:3]:
        assert tok.encode(text, add_special_tokens=True) == hf(text)["input_ids"]
    ids = tok.encode(TEXTS[0], add_special_tokens=True)
    assert ids[0] == tok.bos_token_id and ids[-1] != tok.eos_token_id


def test_resaved_hub_folder_keeps_parity(llama_dir, tmp_path):
    Tokenizer.from_pretrained(llama_dir).save_pretrained(tmp_path / "resaved")
    tok = Tokenizer.from_pretrained(tmp_path / "resaved")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "resaved")
    assert tok.apply_chat_template(CHAT, True) == _hf_chat_ids(hf, CHAT, add_generation_prompt=True)
    assert tok.encode(TEXTS[1], True) == hf(TEXTS[1])["input_ids"]


# --- BPE training


def test_train_bpe_vocab_round_trip_and_reload(tmp_path):
    tok = train_bpe(CORPUS, vocab_size=300)
    assert 256 < tok.vocab_size <= 300
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
        3,
        4,
    ]
    sentence = "the quick brown fox"
    assert len(tok.encode(sentence)) < len(sentence.encode())
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    tok.save_pretrained(tmp_path)
    reloaded = Tokenizer.from_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.vocab_size == tok.vocab_size and reloaded.eos_token_ids == [2, 4]
    for text in TEXTS + CORPUS[:4]:
        assert reloaded.encode(text) == tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert reloaded.apply_chat_template(CHAT) == _hf_chat_ids(hf, CHAT)


def test_train_bpe_extra_specials_follow_reserved_ids():
    tok = train_bpe(CORPUS, vocab_size=300, special_tokens=["<think>"])
    assert tok.token_to_id("<think>") == 8 and tok.encode("<think>") == [8]


def test_train_bpe_rejects_vocab_without_room_for_merges():
    with pytest.raises(TokenizerError, match="vocab_size=200"):
        train_bpe(CORPUS, vocab_size=200)


# --- errors


def test_from_pretrained_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_from_pretrained_missing_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found.*save_pretrained"):
        Tokenizer.from_pretrained(tmp_path)


def test_chat_without_template_names_the_fix():
    tok = Tokenizer.byte_level()
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="chat_template"):
        tok.apply_chat_template(CHAT)
