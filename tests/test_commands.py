"""`astrai-pl generate` and `astrai-pl chat` on a saved debug model: they agree with the engine they drive."""

import io
import json
import re

import pytest
import torch

from astrai_pl.commands import Conversation, chat_ids, chat_verb, generate_verb, prompt_ids
from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives.evaluation import chat_prompts
from astrai_pl.tokenizer import BYTE_OFFSET, Tokenizer

GREEDY = ["--temperature", "0", "--max-tokens", "8"]
PLAIN = ["--no-chat-template"]  # --prompt as plain text (by default it is a user message: the tokenizer has a template)
PRINTABLE = range(BYTE_OFFSET + ord(" "), BYTE_OFFSET + ord("~") + 1)  # ids of the bytes ' ' … '~'


def wide_model() -> Transformer:
    """The debug preset with wide weights, so greedy tokens depend on the weights (and on an adapter)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, {"embed_tokens.weight": 1.0, "lm_head.weight": 0.1}.get(name, 0.2))
    return model


def _chatty_model() -> Transformer:
    """`wide_model` whose greedy replies are printable ASCII: every other output row is zero (logit 0, below
    the best of ~95 random logits), so a reply's text re-encodes to its ids."""
    model = wide_model()
    with torch.no_grad():
        keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
        keep[list(PRINTABLE)] = True
        model.lm_head.weight[~keep] = 0.0
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.byte_level()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("model")
    _chatty_model().save_pretrained(path, tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    return Engine(Transformer.from_pretrained(model_dir).eval(), tokenizer, max_total_tokens=4096, debug=True)


def templated(tokenizer, messages):
    """BOS, then the chat template with its generation prompt: how fine-tuning rows begin."""
    return [tokenizer.bos_token_id, *tokenizer.apply_chat_template(messages, add_generation_prompt=True)]


def test_templated_prompts_match_the_prompts_of_fine_tuning_rows(tokenizer):
    question = "What is 3 + 4?"
    [trained] = chat_prompts([question], tokenizer)
    user = [{"role": "user", "content": question}]
    assert prompt_ids({"messages": user}, tokenizer, False, False) == trained
    assert prompt_ids({"prompt": question}, tokenizer, True, False) == trained
    assert chat_ids(tokenizer, user) == templated(tokenizer, user)


def greedy(engine, prompt, max_tokens=8):
    [out] = engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    return out


def test_generate_prompt_prints_the_engines_greedy_completion(model_dir, engine, capsys):
    generate_verb(["--model", str(model_dir), "--prompt", "Once upon a time", *PLAIN, *GREEDY])
    reference = greedy(engine, "Once upon a time")
    assert capsys.readouterr().out == reference.text + "\n"
    assert reference.finish_reason == "length" and all(t in PRINTABLE for t in reference.token_ids)


def test_generate_prompt_to_a_file_gives_the_same_tokens(model_dir, engine, tmp_path):
    out = tmp_path / "one.jsonl"
    generate_verb(["--model", str(model_dir), "--prompt", "Once upon a time", "--output", str(out), *PLAIN, *GREEDY])
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    reference = greedy(engine, "Once upon a time")
    assert row == {"prompt": "Once upon a time", "completion": reference.text,
                   "finish_reason": reference.finish_reason, "token_ids": reference.token_ids}


def test_generate_jsonl_keeps_fields_and_applies_the_chat_template(model_dir, engine, tokenizer, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rows = [{"prompt": "The cat", "id": 7}, {"messages": messages, "id": 8}, {"prompt": "", "id": 9}]
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "completions.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")  # a blank line is skipped
    generate_verb(["--model", str(model_dir), "--input", str(src), "--output", str(dst), *GREEDY])
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    prompt = templated(tokenizer, messages)
    for row, got, ref in zip(rows, out, [greedy(engine, "The cat"), greedy(engine, prompt)]):
        assert got == {**row, "completion": ref.text, "finish_reason": ref.finish_reason, "token_ids": ref.token_ids}
    assert len(out) == 2 and not list(tmp_path.glob(".*partial"))  # written atomically, nothing left behind

    with_template = tmp_path / "templated.jsonl"
    generate_verb(["--model", str(model_dir), "--input", str(src), "--output", str(with_template), "--chat-template",
                   *GREEDY])
    first = json.loads(with_template.read_text().splitlines()[0])
    user = templated(tokenizer, [{"role": "user", "content": "The cat"}])
    assert first["token_ids"] == greedy(engine, user).token_ids


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "ok"', "not valid JSON"),
    ('{"text": "no prompt"}', 'either "prompt"'),
    ('{"prompt": 3}', "'prompt' must be a string"),
    ('{"messages": [{"content": "no role"}]}', "messages\\[0\\] must be an object with a 'role'"),
    ('{"prompt": ""}', "the prompt is empty"),
])
def test_generate_names_the_file_and_line_of_a_malformed_prompt(model_dir, tmp_path, line, why):
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "completions.jsonl"
    src.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(SystemExit, match=rf"astrai-pl generate: {re.escape(str(src))}:2: .*{why}"):
        generate_verb(["--model", str(model_dir), "--input", str(src), "--output", str(dst), *GREEDY])
    assert not dst.exists()


def test_generate_honours_end_ids_only_in_generation_config(model_dir, engine, tmp_path):
    """An end id listed only in generation_config.json stops the completion there."""
    reference = greedy(engine, "Once upon a time")
    stop_at = reference.token_ids[2]
    local = tmp_path / "model"
    local.mkdir()
    for f in model_dir.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    config = json.loads((local / "generation_config.json").read_text())
    (local / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, stop_at]}))
    out = tmp_path / "out.jsonl"
    generate_verb(["--model", str(local), "--prompt", "Once upon a time", "--output", str(out), *PLAIN, *GREEDY])
    row = json.loads(out.read_text())
    first = reference.token_ids.index(stop_at)
    assert row["finish_reason"] == "stop" and row["token_ids"] == reference.token_ids[: first + 1]


def test_generate_reads_our_checkpoints(model_dir, engine, tmp_path, capsys):
    model = Transformer.from_pretrained(model_dir)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {"arch": model.config.to_dict()}}, ckpt)
    generate_verb(["--model", str(ckpt), "--prompt", "Once upon a time", *PLAIN, *GREEDY])  # tokenizer: 'byte'
    assert capsys.readouterr().out == greedy(engine, "Once upon a time").text + "\n"


def test_generate_refuses_a_missing_model(tmp_path):
    with pytest.raises(SystemExit, match="astrai-pl generate: .*nowhere"):
        generate_verb(["--model", str(tmp_path / "nowhere"), "--prompt", "hi"])


def test_chat_second_reply_equals_one_shot_over_the_templated_conversation(model_dir, engine, tokenizer):
    stdout = io.StringIO()
    chat_verb(["--model", str(model_dir), "--system", "Be brief.", *GREEDY],
              stdin=io.StringIO("Hello there\n\nHow are you?\n/exit\nnever read\n"), stdout=stdout)
    first, second = stdout.getvalue().split("\n")[:2]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert first == greedy(engine, templated(tokenizer, conversation)).text
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "How are you?"}]
    whole = templated(tokenizer, conversation)
    assert second == greedy(engine, whole).text
    assert stdout.getvalue() == f"{first}\n{second}\n"  # /exit stopped the loop


def test_a_conversation_computes_only_each_new_turn(engine, tokenizer):
    chat = Conversation(engine, tokenizer, SamplingParams(max_tokens=8, temperature=0))
    first = "".join(chat.reply("Hello there"))
    held = len(chat.session.tokens)
    before = engine.stats.prefill_tokens
    second = "".join(chat.reply("How are you?"))
    computed = engine.stats.prefill_tokens - before
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "How are you?"}]
    whole = templated(tokenizer, history)
    assert second == greedy(engine, whole).text
    # only the new turn and the last reply token (whose K/V did not exist yet) were computed
    assert computed == len(whole) - held + 1
    assert chat.session.tokens[: len(whole)] == whole

    chat.reset()
    assert chat.messages == [] and chat.session.tokens == []
    assert "".join(chat.reply("Hello there")) == first
    chat.close()
    engine.check()
