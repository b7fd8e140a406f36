"""`astrai-pl generate` and `chat` on a saved RWKV checkpoint: each verb prints what the engine over the same
model decodes greedily (chat keeps the conversation's state in an engine session between turns)."""

import io
import json

import pytest
import test_commands
import torch
from test_commands import GREEDY, PLAIN, PRINTABLE, greedy, templated

from astrai_pl.commands import chat_verb, generate_verb
from astrai_pl.inference import Engine
from astrai_pl.model import ModelConfig, Transformer

tokenizer = test_commands.tokenizer  # the byte tokenizer fixture


def chatty_rwkv() -> Transformer:
    """rwkv-debug with wide random weights whose greedy replies are printable ASCII (the other output rows are
    zero), so a reply's text re-encodes to its ids."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("rwkv-debug")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * (0.5 if p.dim() == 2 else 0.2))
        model.lm_head.weight[[i for i in range(model.config.vocab_size) if i not in PRINTABLE]] = 0.0
    return model


@pytest.fixture(scope="module")
def rwkv_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("rwkv-model")
    chatty_rwkv().save_pretrained(path, tokenizer=tokenizer)
    assert json.loads((path / "config.json").read_text())["model_type"] == "rwkv"
    return path


@pytest.fixture(scope="module")
def engine(rwkv_dir, tokenizer):
    return Engine(Transformer.from_pretrained(rwkv_dir).eval(), tokenizer, max_total_tokens=4096, debug=True)


def test_generate_prints_the_engines_greedy_completion(rwkv_dir, engine, capsys):
    generate_verb(["--model", str(rwkv_dir), "--prompt", "Once upon a time", *PLAIN, *GREEDY])
    reference = greedy(engine, "Once upon a time")
    assert capsys.readouterr().out == reference.text + "\n"
    assert len(reference.token_ids) == 8 and all(t in PRINTABLE for t in reference.token_ids)


def test_chat_second_reply_equals_one_shot_over_the_templated_conversation(rwkv_dir, engine, tokenizer):
    stdout = io.StringIO()
    chat_verb(["--model", str(rwkv_dir), "--system", "Be brief.", *GREEDY],
              stdin=io.StringIO("Hello there\nHow are you?\n/exit\n"), stdout=stdout)
    first, second = stdout.getvalue().split("\n")[:2]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert first == greedy(engine, templated(tokenizer, conversation)).text
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "How are you?"}]
    assert second == greedy(engine, templated(tokenizer, conversation)).text
