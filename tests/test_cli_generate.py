"""`generate --prompt` is a user message through the tokenizer's chat template when the tokenizer has one (as a
chat endpoint), plain text with --no-chat-template or when there is no template; --chat-template still works."""

import json

import pytest
from test_commands import GREEDY, engine, greedy, model_dir, templated, tokenizer  # noqa: F401

from astrai_pl.commands import generate_verb

QUESTION = "What is 3 + 4?"


def test_prompt_goes_through_the_chat_template_by_default(model_dir, engine, tokenizer, capsys):  # noqa: F811
    generate_verb(["--model", str(model_dir), "--prompt", QUESTION, *GREEDY])
    out, err = capsys.readouterr()
    reference = greedy(engine, templated(tokenizer, [{"role": "user", "content": QUESTION}]))
    assert out == reference.text + "\n"
    assert "--no-chat-template" in err  # says what it did and how to turn it off
    generate_verb(["--model", str(model_dir), "--prompt", QUESTION, "--chat-template", *GREEDY])
    assert capsys.readouterr().out == out


def test_no_chat_template_sends_the_prompt_as_plain_text(model_dir, engine, capsys):  # noqa: F811
    generate_verb(["--model", str(model_dir), "--prompt", QUESTION, "--no-chat-template", *GREEDY])
    out, err = capsys.readouterr()
    assert out == greedy(engine, QUESTION).text + "\n" and err == ""


def test_a_tokenizer_without_a_template_keeps_the_prompt_plain(model_dir, engine, tmp_path, capsys):  # noqa: F811
    local = tmp_path / "model"
    local.mkdir()
    for f in model_dir.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    config = json.loads((local / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (local / "tokenizer_config.json").write_text(json.dumps(config))
    generate_verb(["--model", str(local), "--prompt", QUESTION, *GREEDY])
    assert capsys.readouterr().out == greedy(engine, QUESTION).text + "\n"
    with pytest.raises(SystemExit, match="astrai-pl generate: .*no chat_template"):
        generate_verb(["--model", str(local), "--prompt", QUESTION, "--chat-template", *GREEDY])
