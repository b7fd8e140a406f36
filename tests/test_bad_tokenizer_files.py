"""A damaged tokenizer folder, or a chat template that reaches outside the sandbox, gives one TokenizerError
naming the file or the template, the bad value and the fix."""

import io
import json

import jinja2
import pytest

from astrai_pl.commands import chat_verb
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

UNSAFE_TEMPLATE = "{% for m in messages %}{{ m['content'].__class__.__mro__ }}{% endfor %}"


@pytest.fixture
def folder(tmp_path):
    Tokenizer.byte_level().save_pretrained(tmp_path)
    return tmp_path


def edit_config(folder, **fields) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("content", [b"\x00\x9f garbage {", b"[1, 2, 3]", b'{"model": 5}'])
def test_garbage_tokenizer_json_names_the_file(folder, content):
    (folder / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is not a tokenizer file .*; restore it"):
        Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_config_file_that_is_not_an_object_names_the_file(folder, name):
    (folder / name).write_text("[]")
    with pytest.raises(TokenizerError, match=rf"{name} holds a JSON list, not an object"):
        Tokenizer.from_pretrained(folder)


def test_a_config_file_that_is_not_utf8_names_the_file(folder):
    (folder / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xff"}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize(("fields", "message"), [
    ({"eos_token": 7}, r"eos_token is 7; give the token's text as a string"),
    ({"pad_token": {"content": 3}}, r"pad_token is 3; give the token's text"),
    ({"chat_template": 42}, r"chat_template is '42'; give a jinja string"),
    ({"chat_template": [{"name": "default"}]}, r"chat_template is .*; give a jinja string or a list"),
    ({"model_max_length": "long"}, r"model_max_length is 'long'; give a positive number"),
    ({"model_max_length": -5}, r"model_max_length is -5; give a positive number"),
])
def test_a_bad_field_of_tokenizer_config_is_named(folder, fields, message):
    edit_config(folder, **fields)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: " + message):
        Tokenizer.from_pretrained(folder)


def test_an_unsafe_template_is_a_chat_template_error():
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = UNSAFE_TEMPLATE
    with pytest.raises(ChatTemplateError, match=r"the chat template failed: SecurityError: .*unsafe.*; fix") as err:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(err.value, TokenizerError) and isinstance(err.value, jinja2.TemplateError)


def test_chat_with_an_unsafe_template_exits_with_one_line(tmp_path):
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = UNSAFE_TEMPLATE
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path, tokenizer=tokenizer)
    stdout = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        chat_verb(["--model", str(tmp_path), "--max-tokens", "2"], stdin=io.StringIO("hello\n"), stdout=stdout)
    message = str(exit_.value.code)
    assert message.startswith("astrai-pl chat: the chat template failed: SecurityError")
    assert "\n" not in message and "Traceback" not in stdout.getvalue()


def test_chat_whose_template_fails_on_a_later_turn_exits_with_one_line(tmp_path):
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no replies') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path, tokenizer=tokenizer)
    stdout = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        chat_verb(["--model", str(tmp_path), "--max-tokens", "2", "--temperature", "0"],
                  stdin=io.StringIO("hello\nagain\n"), stdout=stdout)
    assert str(exit_.value.code) == ("astrai-pl chat: the chat template failed: TemplateError: no replies; fix the "
                                     f"template ({tmp_path / 'tokenizer_config.json'} 'chat_template'): it "
                                     "runs sandboxed and may only format the messages")
    assert stdout.getvalue().count("\n") == 1  # the first answer was printed
