"""An exported chat model stops where its turns end: generation_config.json lists the chat template's
end-of-turn id next to the model's eos, and `transformers` and our engine both stop there."""

import json

import pytest
import torch

from astrai_pl.callbacks.export import export_pretrained
from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import BYTE_OFFSET, Tokenizer

transformers = pytest.importorskip("transformers")

# A ChatML-like template whose turns end with a token outside the usual end-of-turn names.
CUSTOM_END = "<|reserved_5|>"
CUSTOM_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|reserved_5|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_NEW = 12


def _byte(char: str) -> int:
    return BYTE_OFFSET + ord(char)


def bigram_model(chain: dict[int, int]) -> Transformer:
    """The debug preset turned into a lookup table: after token t the greedy choice is chain[t].

    Every block writes nothing to the residual stream (all matrices zero), token t is embedded as the
    k-th unit vector and lm_head maps that vector to chain[t] alone."""
    model = Transformer(ModelConfig.from_name("debug")).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.zero_()
        for k, (token, following) in enumerate(chain.items()):
            model.embed_tokens.weight[token, k] = 1.0
            model.lm_head.weight[following, k] = 1.0
    return model


def chat_model(tokenizer: Tokenizer, end: int) -> tuple[Transformer, list[int]]:
    """A model that answers any templated question with "hi" and the end-of-turn token, then starts over;
    and a templated prompt."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hey"}], add_generation_prompt=True)
    chain = {prompt[-1]: _byte("h"), _byte("h"): _byte("i"), _byte("i"): end, end: _byte("h")}
    return bigram_model(chain), prompt


def transformers_reply(path, prompt: list[int]) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_chatml_export_stops_at_im_end_in_transformers(tmp_path):
    tokenizer = Tokenizer.byte_level()
    end = tokenizer.token_to_id("<|im_end|>")
    model, prompt = chat_model(tokenizer, end)
    model.save_pretrained(tmp_path, tokenizer=tokenizer)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [model.config.eos_token_id, end]
    assert transformers_reply(tmp_path, prompt) == [_byte("h"), _byte("i"), end]


def test_template_end_of_turn_token_is_found_exported_and_stops_our_engine(tmp_path):
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = CUSTOM_TEMPLATE
    end = tokenizer.token_to_id(CUSTOM_END)
    assert tokenizer.template_end_of_turn_id() == end
    assert end in tokenizer.eos_token_ids
    model, prompt = chat_model(tokenizer, end)
    export_pretrained(model, tmp_path, tokenizer)
    assert transformers_reply(tmp_path, prompt) == [_byte("h"), _byte("i"), end]
    reloaded = Tokenizer.from_pretrained(tmp_path)
    engine = Engine(Transformer.from_pretrained(tmp_path).eval(), reloaded, max_total_tokens=1024)
    [out] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert out.token_ids == [_byte("h"), _byte("i"), end] and out.finish_reason == "stop"
    assert out.text == "hi"


def test_without_a_tokenizer_the_model_eos_alone_is_exported(tmp_path):
    model, _ = chat_model(Tokenizer.byte_level(), 4)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2


def test_a_template_that_cannot_render_a_plain_turn_adds_no_end_id():
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = "{{ raise_exception('a system message is required') }}"
    assert tokenizer.template_end_of_turn_id() is None
    assert tokenizer.eos_token_ids == [2, 4]  # eos and the declared <|im_end|>
