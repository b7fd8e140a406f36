"""A damaged or hand-edited Hugging Face directory gives one typed error naming the file, the field or
tensor, the bad value and the fix; it never loads into a model that computes garbage."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai_pl.commands import generate_verb
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.config import ConfigError
from astrai_pl.model.hf import CheckpointError, NonFiniteWeightError


@pytest.fixture
def saved(tmp_path):
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def write_config(folder, edit) -> None:
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(raw)))


def set_tensor(folder, key, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors[key])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_config_json_that_is_a_list(saved):
    write_config(saved, lambda raw: [raw])
    with pytest.raises(CheckpointError, match=r"config\.json holds a JSON list, not an object\. Fix"):
        Transformer.from_pretrained(saved)


@pytest.mark.parametrize(("field", "value", "type_"), [
    ("num_attention_heads", "8", "int"),
    ("eos_token_id", "two", r"int \| list\[int\] \| None"),
    ("hidden_size", 64.5, "int"),
    ("tie_word_embeddings", "no", "bool"),
    ("rms_norm_eps", None, "float"),
])
def test_config_json_field_of_the_wrong_type(saved, field, value, type_):
    write_config(saved, lambda raw: {**raw, field: value})
    pattern = rf"config\.json: ModelConfig\.{field}={value!r}: must be {type_}, got \w+; \w+"
    with pytest.raises(CheckpointError, match=pattern):
        Transformer.from_pretrained(saved)


@pytest.mark.parametrize(("key", "value"), [("rope_theta", "fast"), ("rope_scaling", [2.0])])
def test_config_json_rope_values(saved, key, value):
    write_config(saved, lambda raw: {**raw, key: value, "rope_parameters": None})
    with pytest.raises(CheckpointError, match=rf"config\.json: key '{key}'.* is {re.escape(repr(value))}.*Fix"):
        Transformer.from_pretrained(saved)


def test_model_config_refuses_wrong_types_and_non_finite_numbers():
    with pytest.raises(ConfigError, match=r"ModelConfig\.num_shared_experts='1': must be int, got str"):
        ModelConfig(num_shared_experts="1")
    with pytest.raises(ConfigError, match=r"ModelConfig\.rope_theta=nan: must be float.*finite"):
        ModelConfig(rope_theta=math.nan)
    with pytest.raises(ConfigError, match=r"ModelConfig\.rope_scaling=.*needs a positive 'factor'"):
        ModelConfig(rope_scaling={"rope_type": "linear", "factor": "two"})


def test_index_whose_weight_map_is_not_a_map(saved):
    (saved / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: 'weight_map' must map.*Fix"):
        Transformer.from_pretrained(saved)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_weight_is_refused_naming_file_and_tensor(saved, bad):
    set_tensor(saved, "model.layers.1.mlp.up_proj.weight", lambda t: t.view(-1)[7:10].fill_(bad))
    pattern = r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' holds 3 NaN/inf value.*Fix"
    with pytest.raises(NonFiniteWeightError, match=pattern):
        Transformer.from_pretrained(saved)


def test_weight_that_overflows_the_load_dtype_is_refused(saved):
    set_tensor(saved, "model.norm.weight", lambda t: t.fill_(1e6))
    assert Transformer.from_pretrained(saved, dtype=torch.bfloat16) is not None
    with pytest.raises(NonFiniteWeightError, match=r"'model\.norm\.weight' overflows torch\.float16.*Fix"):
        Transformer.from_pretrained(saved, dtype=torch.float16)


def test_generate_prints_one_line_for_a_damaged_directory(saved):
    set_tensor(saved, "model.embed_tokens.weight", lambda t: t.fill_(math.nan))
    with pytest.raises(SystemExit) as exit_:
        generate_verb(["--model", str(saved), "--prompt", "hi", "--max-tokens", "2"])
    message = str(exit_.value.code)
    assert message.startswith("astrai-pl generate: ") and "\n" not in message
    assert "'model.embed_tokens.weight'" in message


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_generate_names_an_eos_token_id_that_is_not_a_number(saved, name):
    raw = json.loads((saved / name).read_text())
    (saved / name).write_text(json.dumps({**raw, "eos_token_id": "two"}))
    with pytest.raises(SystemExit) as exit_:
        generate_verb(["--model", str(saved), "--prompt", "hi", "--max-tokens", "2"])
    message = str(exit_.value.code)
    assert message.startswith("astrai-pl generate: ") and "\n" not in message
    assert re.search(rf"{re.escape(name)}: .*eos_token_id.*'two'.*without quotes", message), message
