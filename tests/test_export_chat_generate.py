"""An exported chat model generates in `transformers` (apply_chat_template + greedy generate, what vLLM does
with the same files) exactly what `astrai-pl generate --chat-template` generates on it: the same prompt ids,
BOS first as in every training row, the same tokens, and a stop at the same end-of-turn id."""

import io
import json

import pytest
import torch

from astrai_pl.callbacks.export import export_pretrained
from astrai_pl.commands import chat_ids, generate_verb
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import CHATML_TEMPLATE, Tokenizer

transformers = pytest.importorskip("transformers")

MAX_NEW = 10
CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "7 - 4 ="}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "and now?"}],
]


def _final_hidden(model: Transformer, ids: list[int]) -> torch.Tensor:
    """The final norm's output at the last position: what lm_head reads."""
    seen = []
    handle = model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out[0, -1]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    handle.remove()
    return seen[0]


def chat_model(tokenizer: Tokenizer) -> Transformer:
    """The debug preset with random weights, except that `<|im_end|>` is the greedy choice 3 tokens into the
    first chat's answer (and wherever else the hidden state points the same way)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug")).eval()
    end = tokenizer.token_to_id("<|im_end|>")
    ids = chat_ids(tokenizer, CHATS[0])
    with torch.no_grad():
        model.lm_head.weight[end] = 0.0
        for _ in range(3):
            ids = [*ids, int(model(torch.tensor([ids])).logits[0, -1].argmax())]
        hidden = _final_hidden(model, ids)
        top = model(torch.tensor([ids])).logits[0, -1].max()
        model.lm_head.weight[end] = hidden * (top + 1.0) / hidden.square().sum()
    return model


def engine_replies(folder, tmp_path) -> list[dict]:
    """`astrai-pl generate --chat-template --temperature 0` on the exported folder: one record per chat."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"messages": chat} for chat in CHATS[1:]]
    rows.insert(0, {"prompt": CHATS[0][0]["content"]})  # a plain prompt, templated by --chat-template
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    stdout = io.StringIO()
    generate_verb(["--model", str(folder), "--input", str(prompts), "--chat-template", "--temperature", "0",
                   "--max-tokens", str(MAX_NEW), "--device", "cpu", "--max-total-tokens", "1024"], stdout=stdout)
    return [json.loads(line) for line in stdout.getvalue().splitlines()]


def transformers_replies(folder) -> tuple[list[list[int]], list[list[int]]]:
    """apply_chat_template (generation prompt) and greedy generate in transformers: prompt ids, new ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts, replies = [], []
    for chat in CHATS:
        inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        prompt = inputs["input_ids"][0].tolist()
        prompts.append(prompt)
        replies.append(out[0, len(prompt):].tolist())
    return prompts, replies


def test_transformers_generate_on_an_export_equals_astrai_generate(tmp_path):
    tokenizer = Tokenizer.byte_level()
    end = tokenizer.token_to_id("<|im_end|>")
    folder = tmp_path / "hf"
    export_pretrained(chat_model(tokenizer), folder, tokenizer)
    ours = engine_replies(folder, tmp_path)
    prompts, replies = transformers_replies(folder)
    assert prompts == [chat_ids(tokenizer, chat) for chat in CHATS]
    assert all(prompt[0] == tokenizer.bos_token_id for prompt in prompts)
    assert replies == [record["token_ids"] for record in ours]
    stopped = [record for record in ours if record["finish_reason"] == "stop"]
    assert stopped and all(record["token_ids"][-1] == end for record in stopped)
    assert ours[0]["finish_reason"] == "stop"


def test_the_exported_template_gains_the_bos_only_where_it_lacks_one():
    tokenizer = Tokenizer.byte_level()
    assert tokenizer.exported_chat_template() == "{{ bos_token }}" + CHATML_TEMPLATE
    tokenizer.chat_template = "{{ bos_token }}" + CHATML_TEMPLATE
    assert tokenizer.exported_chat_template() == tokenizer.chat_template
    no_bos = Tokenizer(tokenizer.backend, {"eos_token": "<eos>"}, CHATML_TEMPLATE)
    assert no_bos.exported_chat_template() == CHATML_TEMPLATE


def test_a_reloaded_export_templates_the_same_ids_as_the_tokenizer_it_came_from(tmp_path):
    tokenizer = Tokenizer.byte_level()
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path, tokenizer=tokenizer)
    reloaded = Tokenizer.from_pretrained(tmp_path)
    for chat in CHATS:
        assert chat_ids(reloaded, chat) == chat_ids(tokenizer, chat)
        assert reloaded.apply_chat_template(chat, add_generation_prompt=True) == chat_ids(tokenizer, chat)
