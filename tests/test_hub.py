"""Models and data sets by hub id, read from a hub cache laid out on disk here, in offline mode: no test reaches
a hub. The layout is the one huggingface_hub reads: <cache>/models--owner--name/{blobs,snapshots/<sha>,refs/main}."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from astrai_pl.checkpoint.loading import load_transformer
from astrai_pl.data import PretrainData, SFTData
from astrai_pl.hub import HubError, HubName, hub_name, resolve_dataset, resolve_model, resolve_model_option
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.verbs import main


def lay_out(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes], ref: str = "main") -> str:
    """Put `files` into the hub cache as one snapshot of `repo_id`, named by `ref`; returns its commit."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(json.dumps(sorted((k, len(v)) for k, v in files.items())).encode()).hexdigest()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug"))
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    return model, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache under tmp_path, offline; the working directory is tmp_path too (no stray owner/)."""
    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return hub


def test_which_names_are_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_name("acme/tiny") == HubName("acme/tiny", None)
    assert hub_name("acme/tiny@v1.0") == HubName("acme/tiny", "v1.0")
    assert hub_name("acme/tiny", revision="abc") == HubName("acme/tiny", "abc")
    assert hub_name("hf://acme/tiny") == HubName("acme/tiny", None)
    assert hub_name("hf://datasets/acme/rows", repo_type="dataset") == HubName("acme/rows", None)
    for path in ("my-model", "./acme/tiny", "/abs/acme", "runs/x/latest/hf", "acme/last.ckpt", "acme/rows.jsonl"):
        assert hub_name(path) is None, path
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    assert hub_name("acme/tiny") is None  # an existing path is a path
    assert hub_name("acme/other") is None  # under an existing folder: a missing local file, not a hub id
    assert hub_name("hf://acme/tiny") == HubName("acme/tiny", None)  # hf:// always means the hub
    with pytest.raises(HubError, match="'v1' and --revision says 'v2'"):
        hub_name("elsewhere/tiny@v1", revision="v2")
    with pytest.raises(HubError, match="local path"):
        hub_name("acme/tiny", revision="v1")
    with pytest.raises(HubError, match="not a hub id"):
        hub_name("hf://just-a-name")


def test_init_from_a_hub_id_loads_the_cached_snapshot(cache, tiny):
    model, files = tiny
    commit = lay_out(cache, "model", "acme/tiny", files)
    assert resolve_model("acme/tiny") == str(cache / "models--acme--tiny" / "snapshots" / commit)
    for name in ("acme/tiny", "hf://acme/tiny", f"acme/tiny@{commit}", "acme/tiny@main"):
        loaded = load_transformer(None, name)
        for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
            assert torch.equal(a, b), (name, k)



def test_a_meta_device_build_reads_a_hub_id_as_load_transformer_does(cache, tiny):
    from astrai_pl.checkpoint.loading import meta_transformer

    model, files = tiny
    commit = lay_out(cache, "model", "acme/tiny", files)
    built, folder = meta_transformer(None, "acme/tiny")
    assert folder == cache / "models--acme--tiny" / "snapshots" / commit
    shapes = {k: v.shape for k, v in built.state_dict().items()}
    assert shapes == {k: v.shape for k, v in model.state_dict().items()}
    assert next(built.parameters()).device.type == "meta"

def test_a_local_folder_wins_over_the_hub_id_it_spells(cache, tiny, tmp_path):
    model, files = tiny
    lay_out(cache, "model", "acme/tiny", files)
    torch.manual_seed(1)
    other = Transformer(ModelConfig.from_name("debug"))
    other.save_pretrained(tmp_path / "acme" / "tiny")
    first = next(iter(load_transformer(None, "acme/tiny").state_dict().values()))
    assert torch.equal(first, next(iter(other.state_dict().values())))
    assert not torch.equal(first, next(iter(model.state_dict().values())))


def test_missing_id_unknown_revision_and_pickle_only_repos_are_named(cache, tiny):
    _, files = tiny
    with pytest.raises(HubError, match=r"'acme/absent'.*HF_HUB_OFFLINE=1.*HF_TOKEN"):
        resolve_model("acme/absent")
    lay_out(cache, "model", "acme/tiny", files)
    with pytest.raises(HubError, match=r"'acme/tiny' at revision 'v9'.*HF_HUB_OFFLINE"):
        resolve_model("acme/tiny", revision="v9")
    lay_out(cache, "model", "acme/pickled", {"config.json": files["config.json"], "pytorch_model.bin": b"x"})
    with pytest.raises(HubError, match="'acme/pickled'.*only safetensors"):
        load_transformer(None, "acme/pickled")


def test_generate_and_convert_take_a_hub_id(cache, tiny, tmp_path, capsys):
    model, files = tiny
    lay_out(cache, "model", "acme/tiny", files)
    main(["generate", "--model", "acme/tiny", "--revision", "main", "--prompt", "hi", "--max-tokens", "3",
          "--temperature", "0", "--no-chat-template"])
    assert capsys.readouterr().out.strip()  # three generated tokens, printed
    main(["convert", "--ckpt", "acme/tiny", "--output", str(tmp_path / "out")])
    copy = Transformer.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), copy.state_dict().values()))
    with pytest.raises(SystemExit, match=r"astrai-pl convert: hub model 'acme/absent'.*HF_HUB_OFFLINE"):
        main(["convert", "--ckpt", "acme/absent", "--output", str(tmp_path / "none")])


def test_a_server_names_the_model_by_its_hub_id(cache, tiny):
    lay_out(cache, "model", "acme/tiny", tiny[1])
    ns = argparse.Namespace(model="acme/tiny@main", revision=None, served_model_name=None)
    resolve_model_option(ns)
    assert ns.served_model_name == "acme/tiny" and Path(ns.model).is_dir()
    resolve_model_option(ns)  # resolving again leaves the folder as it is
    assert ns.served_model_name == "acme/tiny" and Path(ns.model).is_dir()


def test_data_path_reads_a_hub_data_set_from_the_cache(cache):
    rows = [{"prompt": f"Q{i}: 2+2?", "completion": " 4"} for i in range(24)]
    jsonl = "\n".join(json.dumps(r) for r in rows).encode()
    held_out = "\n".join(json.dumps(r) for r in rows[:3]).encode()
    lay_out(cache, "dataset", "acme/rows", {"data/train.jsonl": jsonl, "data/test.jsonl": held_out})
    assert resolve_dataset("acme/rows@main").startswith(str(cache / "datasets--acme--rows"))
    data = SFTData(path="acme/rows", packing="none", max_seq_len=32, val_split="test")
    data.setup()
    assert len(data.train_set) == 24 and len(data.val_set) == 3
    with pytest.raises(HubError, match=r"hub dataset 'acme/none'.*HF_HUB_OFFLINE"):
        SFTData(path="acme/none", packing="none", max_seq_len=32).setup()


def test_pretraining_documents_from_a_hub_data_set_cache_by_its_snapshot(cache, tmp_path):
    docs = [json.dumps({"text": f"document {i} " * 20}) for i in range(40)]
    lay_out(cache, "dataset", "acme/docs", {"train.jsonl": "\n".join(docs).encode()})
    data = PretrainData(path="acme/docs", seq_len=32, val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    data.setup()
    assert len(data.train_set) > 0 and len(data.val_set) > 0
    before = data._cache_key()
    lay_out(cache, "dataset", "acme/docs", {"train.jsonl": "\n".join(docs[:20]).encode()})  # main moves on
    assert PretrainData(path="acme/docs", seq_len=32, cache_dir=str(tmp_path / "cache"))._cache_key() != before


def test_the_environment_chooses_the_cache_and_offline_mode(tmp_path, tiny):
    """HF_HOME and HF_HUB_OFFLINE as a user sets them, read by huggingface_hub when it is imported."""
    lay_out(tmp_path / "home" / "hub", "model", "acme/tiny", tiny[1])
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("HF_HUB_CACHE", None)
    code = "from astrai_pl.hub import resolve_model; print(resolve_model('acme/tiny'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path / "home" / "hub" / "models--acme--tiny" / "snapshots"))


ONLINE = """
import json, sys
from pathlib import Path
from astrai_pl.hub import HubError, resolve_dataset, resolve_model
out = {}
for kind, name in json.loads(sys.argv[1]):
    try:
        folder = (resolve_model if kind == "model" else resolve_dataset)(name)
        out[name] = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())
    except HubError as err:
        out[name] = str(err)
print(json.dumps(out))
"""


def run_online(tmp_path, endpoint: str, names: list[tuple[str, str]]) -> dict:
    """`names` resolved in a fresh process whose environment points huggingface_hub at `endpoint`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
    env.update(HF_HOME=str(tmp_path / "home"), HF_ENDPOINT=endpoint, HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=str(Path(__file__).parents[1]), NO_PROXY="127.0.0.1")
    done = subprocess.run([sys.executable, "-c", ONLINE, json.dumps(names)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_online_fetch_takes_safetensors_and_data_files_only_and_names_what_is_missing(tmp_path, tiny):
    from hub_server import FakeHub

    hub = FakeHub()
    try:
        hub.add("models", "acme/tiny", {**tiny[1], "pytorch_model.bin": b"pickle", "modeling_tiny.py": b"import os"})
        rows = "\n".join(json.dumps({"prompt": "2+2?", "completion": " 4"}) for _ in range(4)).encode()
        hub.add("datasets", "acme/rows", {"data/train.jsonl": rows, "rows.py": b"import os", "README.md": b"# rows"})
        got = run_online(tmp_path, hub.endpoint, [("model", "acme/tiny"), ("dataset", "acme/rows"),
                                                   ("model", "acme/absent"), ("model", "acme/tiny@v9")])
    finally:
        hub.close()
    # config, safetensors, generation config; not the export's own manifest, which the allow-list leaves out
    assert got["acme/tiny"] == sorted(n for n in tiny[1] if not n.startswith(".astrai-pl-export"))
    assert got["acme/rows"] == ["README.md", "data/train.jsonl"]
    assert not [r for r in hub.requests if r.endswith((".bin", ".py"))]  # never asked for
    assert "'acme/absent' was not found on the hub" in got["acme/absent"] and "HF_TOKEN" in got["acme/absent"]
    assert "'acme/tiny' at revision 'v9': no such revision" in got["acme/tiny@v9"]


def test_an_unreachable_hub_without_a_cached_copy_is_named(tmp_path):
    import socket

    with socket.socket() as closed:  # a port nothing listens on once this block ends
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    got = run_online(tmp_path, f"http://127.0.0.1:{port}", [("model", "acme/tiny")])
    assert "'acme/tiny': the hub could not be reached and the hub cache holds no copy" in got["acme/tiny"]


def test_a_tokenizer_by_hub_id_reads_only_its_files(cache, tmp_path):
    from astrai_pl.tokenizer import Tokenizer, load_tokenizer

    saved = tmp_path / "tok"
    Tokenizer.byte_level().save_pretrained(saved)
    lay_out(cache, "model", "acme/tok", {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()})
    text = "What is 2 + 3?"
    assert load_tokenizer("acme/tok").encode(text) == Tokenizer.byte_level().encode(text)
    assert load_tokenizer("acme/tok").chat_template == Tokenizer.byte_level().chat_template
    lay_out(cache, "model", "acme/no-tok", {"config.json": b"{}"})
    with pytest.raises(HubError, match="'acme/no-tok'.*no tokenizer.json"):
        load_tokenizer("acme/no-tok")
