"""Adapter, LoRA checkpoint and chat-template files that used to hang or give a traceback: each is now one
typed error naming the file and the field, found in bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from astrai_pl.checkpoint import load_transformer
from astrai_pl.cli import main as cli_main
from astrai_pl.model import ConfigError, LoraConfig, ModelConfig, Transformer
from astrai_pl.model.adapter_files import load_adapter
from astrai_pl.model.hf import CheckpointError
from astrai_pl.tokenizer import ChatTemplateError, Tokenizer


def _adapter_dir(folder, **config):
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, **config}))
    save_file({}, str(folder / "adapter_model.safetensors"))
    return folder


# -- target_modules: a regex that backtracks for hours under Python's re -----------------------------------
CHILD = """
import sys
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.adapter_files import load_adapter
try:
    load_adapter(Transformer(ModelConfig.from_name("debug")), sys.argv[1])
except ValueError as err:
    print(err)
"""


@pytest.mark.parametrize("pattern", ["((.+))+Z", "(?:.|.)*Z"])
def test_a_catastrophic_target_regex_is_matched_in_linear_time(tmp_path, pattern):
    folder = _adapter_dir(tmp_path / "adapter", target_modules=pattern)
    child = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})  # Python's re: hours
    assert child.returncode == 0, child.stderr[-2000:]
    assert f"{folder / 'adapter_config.json'}: " in child.stdout and "matches no linear layer" in child.stdout


def test_a_regex_re2_cannot_compile_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"target_modules='\(\?=q\)\.\*' is not a regular expression RE2 accepts"):
        LoraConfig(target_modules="(?=q).*")
    assert LoraConfig(target_modules=r".*\.(q|v)_proj").target_modules == r".*\.(q|v)_proj"


def test_a_regex_selects_the_same_modules_as_before():
    from astrai_pl.model.lora import target_names

    model = Transformer(ModelConfig.from_name("debug"))
    names = target_names(model, LoraConfig(target_modules=r"model\.layers\.1\.self_attn\.(q|v)_proj"))
    assert names == ["layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"]


# -- r: bounded by the layer's size -------------------------------------------------------------------------
def test_a_huge_rank_is_refused_naming_the_file_and_the_bound(tmp_path):
    folder = _adapter_dir(tmp_path / "adapter", r=100_000_000_000, target_modules=["q_proj", "v_proj"])
    model = Transformer(ModelConfig.from_name("debug"))
    with pytest.raises(CheckpointError, match=rf"{folder / 'adapter_config.json'}: .*\.r=100000000000: larger "
                                              r"than .*v_proj \(64 -> 32\).*r <= 32"):
        load_adapter(model, folder)


def test_a_huge_rank_in_a_checkpoint_is_refused_naming_it(tmp_path):
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"arch": ModelConfig.from_name("debug").to_dict(),
                                                       "lora": {"r": 100_000_000_000}}}, path)
    with pytest.raises(CheckpointError, match=rf"{path}: hyper_parameters\.lora: .*r <= 32"):
        load_transformer(None, str(path))


# -- LoRA checkpoints whose bases name each other -------------------------------------------------------------
def _lora_checkpoint(path, base):
    torch.save({"state_dict": {}, "lora_base": {"init_from": str(base), "fingerprint": None},
                "hyper_parameters": {"arch": ModelConfig.from_name("debug").to_dict(), "lora": {"r": 2}}}, path)


def test_lora_checkpoints_whose_bases_name_each_other_are_refused_by_path(tmp_path):
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    _lora_checkpoint(first, second)
    _lora_checkpoint(second, first)
    with pytest.raises(CheckpointError, match="lead in a circle") as info:
        load_transformer(None, str(first))
    message = str(info.value)
    assert f"{first} -> {second} -> {first}" in message and len(message) < 2000


# -- a chat template that hands json.dumps a class ------------------------------------------------------------
BAD_TEMPLATE = "{{ messages|tojson(cls=dict) }}"


@pytest.fixture
def bad_template_dir(tmp_path):
    folder = tmp_path / "model"
    Transformer(ModelConfig.from_name("debug")).save_pretrained(folder, tokenizer=Tokenizer.byte_level())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": BAD_TEMPLATE}))
    return folder


def test_tojson_with_a_class_is_a_chat_template_error_naming_the_template(bad_template_dir):
    tokenizer = Tokenizer.from_pretrained(bad_template_dir)
    with pytest.raises(ChatTemplateError, match=rf"{bad_template_dir / 'tokenizer_config.json'} 'chat_template'"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(SystemExit, match=r"^astrai-pl generate: --prompt: the chat template failed: .*tojson"):
        cli_main(["generate", "--model", str(bad_template_dir), "--prompt", "hi", "--max-tokens", "1"])


def test_the_server_answers_400_naming_the_template(bad_template_dir):
    from fastapi.testclient import TestClient

    from astrai_pl.inference import Engine
    from astrai_pl.serve.app import create_app
    from astrai_pl.serve.state import ServerState

    tokenizer = Tokenizer.from_pretrained(bad_template_dir)
    engine = Engine(Transformer.from_pretrained(bad_template_dir).eval(), tokenizer, max_total_tokens=1024)
    with TestClient(create_app(ServerState(engine, tokenizer, "m"))) as client:
        reply = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400, reply.text
    assert "the chat template failed" in reply.text and "tojson" in reply.text
