"""Several LoRA adapters served at once on one engine: a mixed batch gives each request exactly the greedy tokens
of its adapter merged into the base offline; adapters load and unload at run time; the prefix cache never
shares K/V between adapters; a session stays on the adapter it started with."""

import json

import pytest
import torch

from astrai_pl.inference import Engine, SamplingParams, SessionError
from astrai_pl.inference.adapters import (
    AdapterInUseError,
    load_lora_adapter,
    lora_adapters,
    unload_lora_adapter,
)
from astrai_pl.inference.sampling import SamplingParamsError
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.config import ConfigError
from astrai_pl.model.hf_config import CheckpointError
from astrai_pl.model.lora import LoraConfig, apply_lora, merge_lora

# three adapters of different ranks and targets
ADAPTERS = {
    "qv": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "all": LoraConfig(r=8, lora_alpha=8, target_modules="all-linear"),
    "mlp": LoraConfig(r=4, lora_alpha=16, target_modules=["o_proj", "down_proj"], use_rslora=True),
}
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9], list(range(30, 70)), [200, 201, 202, 203]]
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


def save_adapter_dir(base_dir, path, lora: LoraConfig, seed: int) -> None:
    """A PEFT adapter on the base in `base_dir` with random A and B (B != 0, so it changes the outputs)."""
    model = Transformer.from_pretrained(base_dir)
    apply_lora(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_lora")
    torch.manual_seed(0)
    Transformer(ModelConfig.from_name("debug")).save_pretrained(root / "base")
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        save_adapter_dir(root / "base", root / name, lora, seed)
    return root


@pytest.fixture(scope="module")
def merged_outputs(dirs):
    """Each adapter's (and the base's) greedy tokens for every prompt, from its own engine on merged weights."""
    out = {}
    for name in [None, *ADAPTERS]:
        model = Transformer.from_pretrained(dirs / "base", adapter=None if name is None else dirs / name)
        model = merge_lora(model) if name is not None else model
        engine = Engine(model.eval(), max_total_tokens=2048)
        out[name] = [c.token_ids for c in engine.generate(PROMPTS, SamplingParams(**GREEDY))]
    return out


def served_engine(dirs) -> Engine:
    engine = Engine(Transformer.from_pretrained(dirs / "base").eval(), max_total_tokens=2048, debug=True)
    for name in ADAPTERS:
        load_lora_adapter(engine, name, dirs / name)
    return engine


def test_a_mixed_batch_gives_each_request_its_adapters_merged_output(dirs, merged_outputs):
    assert all(merged_outputs[name] != merged_outputs[None] for name in ADAPTERS)  # each adapter matters
    engine = served_engine(dirs)
    names = [None, *ADAPTERS] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    params = [SamplingParams(**GREEDY, lora_name=n) for n in names]
    for i, completion in enumerate(engine.generate(prompts, params)):  # one batch: every row its own adapter
        assert completion.token_ids == merged_outputs[names[i]][i % len(PROMPTS)], names[i]


def test_adapters_load_and_unload_at_run_time(dirs, merged_outputs):
    engine = Engine(Transformer.from_pretrained(dirs / "base").eval(), max_total_tokens=2048)
    with pytest.raises(SamplingParamsError, match="lora_name='qv'.*no such adapter"):
        engine.generate([PROMPTS[0]], SamplingParams(**GREEDY, lora_name="qv"))
    load_lora_adapter(engine, "qv", dirs / "qv")
    assert sorted(lora_adapters(engine)) == ["qv"]
    [out] = engine.generate([PROMPTS[0]], SamplingParams(**GREEDY, lora_name="qv"))
    assert out.token_ids == merged_outputs["qv"][0]
    engine.add_request(PROMPTS[1], SamplingParams(**GREEDY, lora_name="qv"))
    with pytest.raises(AdapterInUseError, match="'qv' serves 1 queued or running"):
        unload_lora_adapter(engine, "qv")
    while engine.has_unfinished():
        engine.step()
    unload_lora_adapter(engine, "qv")
    assert lora_adapters(engine) == {}
    [base] = engine.generate([PROMPTS[0]], SamplingParams(**GREEDY))
    assert base.token_ids == merged_outputs[None][0]  # the base is exactly the base again
    with pytest.raises(KeyError):
        unload_lora_adapter(engine, "qv")


def test_a_bad_adapter_folder_is_refused_naming_the_problem(dirs, tmp_path):
    engine = Engine(Transformer.from_pretrained(dirs / "base").eval(), max_total_tokens=1024)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora=True is not supported"):
        load_lora_adapter(engine, "bad", bad)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_lora_adapter(engine, "none", tmp_path / "missing")
    load_lora_adapter(engine, "qv", dirs / "qv")
    with pytest.raises(ConfigError, match="'qv' is already loaded"):
        load_lora_adapter(engine, "qv", dirs / "qv")
    assert sorted(lora_adapters(engine)) == ["qv"]


def test_the_prefix_cache_is_not_shared_between_adapters(dirs):
    engine = served_engine(dirs)
    prompt = list(range(40, 100))  # several full pages
    first = engine.generate([prompt], SamplingParams(max_tokens=1, lora_name="qv"))[0]
    assert first.cached_tokens == 0
    for name in (None, "all", "mlp"):
        assert engine.generate([prompt], SamplingParams(max_tokens=1, lora_name=name))[0].cached_tokens == 0
    again = engine.generate([prompt], SamplingParams(max_tokens=1, lora_name="qv"))[0]
    assert again.cached_tokens > 0  # within one adapter the prefix is shared as before
    # a base request whose own salt spells an adapter's is still the base's
    spelled = SamplingParams(max_tokens=1, cache_salt="lora:1:qv|")
    assert engine.generate([prompt], spelled)[0].cached_tokens == 0


def test_a_session_stays_on_the_adapter_it_started_with(dirs):
    engine = served_engine(dirs)
    session = engine.session()
    session.generate([1, 2, 3], SamplingParams(max_tokens=2, lora_name="mlp"))
    with pytest.raises(SamplingParamsError, match="adapter 'mlp'"):
        session.generate([4, 5], SamplingParams(max_tokens=2, lora_name="all"))
    session.generate([4, 5], SamplingParams(max_tokens=2, lora_name="mlp"))


def test_a_fork_keeps_the_adapter_and_an_adapter_session_is_not_saved(dirs, tmp_path):
    engine = served_engine(dirs)
    session = engine.session()
    session.generate([1, 2, 3], SamplingParams(max_tokens=2, lora_name="qv"))
    child = session.fork()
    with pytest.raises(SamplingParamsError, match="adapter 'qv'"):
        child.generate([4], SamplingParams(max_tokens=1))  # the base would reuse the adapter's K/V
    child.generate([4], SamplingParams(max_tokens=1, lora_name="qv"))
    with pytest.raises(SessionError, match="LoRA adapter 'qv'"):
        session.save(tmp_path / "s.safetensors")
