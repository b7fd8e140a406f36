"""Several LoRA adapters behind one server, with the official `openai` client on loopback: each model id gets its
adapter's greedy output (that of the adapter merged offline) while requests for different ids run together;
adapters load and unload at run time behind the API key, a bad folder answers 400 naming the problem; cached
prompt prefixes are never shared between adapters."""

import asyncio
import json

import httpx
import openai
import pytest
import test_commands
import torch
from served import TIMEOUT, running

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.inference.adapters import load_lora_adapter
from astrai_pl.model import Transformer
from astrai_pl.model.lora import LoraConfig, apply_lora, merge_lora
from astrai_pl.serve.lora_models import parse_lora_module
from astrai_pl.serve.state import ServerState
from astrai_pl.tokenizer import Tokenizer

tokenizer, model_dir = test_commands.tokenizer, test_commands.model_dir
BASE = "base-chat"
ADAPTERS = {"qv": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
            "all": LoraConfig(r=8, lora_alpha=8, target_modules="all-linear"),
            "mlp": LoraConfig(r=4, lora_alpha=16, target_modules=["o_proj", "down_proj"])}
PROMPT = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101, 44, 32, 119, 111, 114, 108, 100]  # "Hello there, world"
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        model = Transformer.from_pretrained(model_dir)
        apply_lora(model, lora)
        gen = torch.Generator().manual_seed(10 + seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if ".lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        model.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def merged_ids(model_dir, adapter_dirs):
    out = {}
    for name in [BASE, *ADAPTERS]:
        model = Transformer.from_pretrained(model_dir, adapter=None if name == BASE else adapter_dirs / name)
        model = model if name == BASE else merge_lora(model)
        [done] = Engine(model.eval(), max_total_tokens=1024).generate([PROMPT], SamplingParams(**GREEDY))
        out[name] = done.token_ids
    return out


def serving_engine(model_dir, adapter_dirs, names=tuple(ADAPTERS)) -> Engine:
    engine = Engine(Transformer.from_pretrained(model_dir).eval(), tokenizer=Tokenizer.byte_level(),
                    max_total_tokens=2048)
    for name in names:
        load_lora_adapter(engine, name, adapter_dirs / name)
    return engine


async def ask_all(url: str, ids: list[str]) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", timeout=TIMEOUT, max_retries=0) as client:
        return await asyncio.gather(*(client.completions.create(
            model=m, prompt=PROMPT, max_tokens=GREEDY["max_tokens"], temperature=0, logprobs=0,
            extra_body={"ignore_eos": True}) for m in ids))


def test_each_model_id_gets_its_adapters_merged_output(model_dir, adapter_dirs, merged_ids):
    assert all(merged_ids[name] != merged_ids[BASE] for name in ADAPTERS)  # each adapter matters
    engine = serving_engine(model_dir, adapter_dirs)
    state = ServerState(engine, engine.tokenizer, BASE)
    with running(state) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="k", timeout=TIMEOUT, max_retries=0) as client:
            cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {BASE, *ADAPTERS}
        assert all(cards[name].parent == BASE for name in ADAPTERS)
        ids = [BASE, *ADAPTERS] * 2
        answers = asyncio.run(ask_all(url, ids))  # in flight together: one batch, every row its own adapter
    for model, answer in zip(ids, answers):
        assert answer.model == model
        expected = engine.tokenizer.decode(merged_ids[model])
        assert answer.choices[0].text == expected, model
    engine.stop()


def test_adapters_load_and_unload_at_run_time_behind_the_key(model_dir, adapter_dirs, merged_ids, tmp_path):
    engine = serving_engine(model_dir, adapter_dirs, names=())
    state = ServerState(engine, engine.tokenizer, BASE, api_key="secret")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    key = {"Authorization": "Bearer secret"}
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        load = {"lora_name": "qv", "lora_path": str(adapter_dirs / "qv")}
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 401
        refused = http.post("/v1/load_lora_adapter", headers=key, json={"lora_name": "x", "lora_path": str(bad)})
        assert refused.status_code == 400 and "use_dora=True is not supported" in refused.json()["error"]["message"]
        missing = http.post("/v1/load_lora_adapter", headers=key, json={"lora_name": "x", "lora_path": "/nowhere"})
        assert missing.status_code == 400 and "not a directory" in missing.json()["error"]["message"]
        assert http.post("/v1/load_lora_adapter", headers=key, json=load).status_code == 200
        assert [m["id"] for m in http.get("/v1/models", headers=key).json()["data"]] == [BASE, "qv"]
        body = {"model": "qv", "prompt": PROMPT, **GREEDY}
        done = http.post("/v1/completions", headers=key, json=body)
        assert done.status_code == 200 and done.json()["choices"][0]["text"] == engine.tokenizer.decode(merged_ids["qv"])
        assert http.post("/v1/unload_lora_adapter", headers=key, json={"lora_name": "qv"}).status_code == 200
        gone = http.post("/v1/completions", headers=key, json=body)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        again = http.post("/v1/unload_lora_adapter", headers=key, json={"lora_name": "qv"})
        assert again.status_code == 404
    engine.stop()


def test_cached_prefixes_are_not_shared_between_adapters(model_dir, adapter_dirs):
    engine = serving_engine(model_dir, adapter_dirs)
    state = ServerState(engine, engine.tokenizer, BASE, report_cached_tokens=True)
    prompt = PROMPT * 4  # several full pages

    def cached(http, model) -> int:
        r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        assert cached(http, "qv") == 0
        assert [cached(http, m) for m in (BASE, "all", "mlp")] == [0, 0, 0]
        assert cached(http, "qv") > 0  # within one adapter the prefix is shared as before
    engine.stop()


def test_lora_modules_accept_vllms_two_forms():
    assert parse_lora_module("sql=adapters/sql") == ("sql", "adapters/sql")
    assert parse_lora_module('{"name": "sql", "path": "a/b", "base_model_name": "m"}') == ("sql", "a/b")
    with pytest.raises(ValueError, match="name=DIR"):
        parse_lora_module("adapters/sql")


def test_a_session_keeps_the_adapter_it_was_opened_with(model_dir, adapter_dirs):
    engine = serving_engine(model_dir, adapter_dirs)
    state = ServerState(engine, engine.tokenizer, BASE)
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        sid = http.post("/v1/sessions", json={"model": "mlp", "messages": [{"role": "system", "content": "x"}]})
        assert sid.status_code == 200, sid.text
        path = f"/v1/sessions/{sid.json()['id']}/chat/completions"
        first = http.post(path, json=turn)
        assert first.status_code == 200 and first.json()["model"] == "mlp", first.text
        other = http.post(path, json={**turn, "model": "all"})
        assert other.status_code == 400 and "adapter 'mlp'" in other.json()["error"]["message"], other.text
        assert http.post(path, json={**turn, "model": "mlp"}).status_code == 200
    engine.stop()
