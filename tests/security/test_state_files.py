"""Saved RWKV states are untrusted files: another model's, a reshaped, non-finite, truncated or foreign file is
refused with an error naming the file and the field, and nothing in a file runs code."""

import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from astrai_pl.inference import SessionError, StateSession
from astrai_pl.model import ModelConfig, Transformer


def rwkv_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_name("rwkv-debug", **overrides)).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = rwkv_model()
    path = tmp_path_factory.mktemp("state") / "chat.safetensors"
    StateSession.warm(model, [5, 6, 7, 8]).save(path, dtype=torch.float16)
    return model, path


def rewrite(path, out, tensors=None, metadata=None):
    """A copy of a state file with tensors replaced (a function of the old one, or None to drop it) and header
    entries set."""
    with safe_open(str(path), framework="pt") as f:
        header = {**f.metadata(), **(metadata or {})}
        data = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for name, edit in (tensors or {}).items():
        data[name] = edit(data[name]) if callable(edit) else edit
    save_file({name: t for name, t in data.items() if t is not None}, str(out), metadata=header)
    return out


def poke(value):
    def edit(t):
        t = t.clone()
        t.view(-1)[3] = value
        return t

    return edit


TAMPERED = {
    "nan_aa": (dict(tensors={"aa": poke(float("nan"))}), "aa holds NaN or inf"),
    "inf_shift": (dict(tensors={"att_shift": poke(float("inf"))}), "att_shift holds NaN or inf"),
    "negative_bb": (dict(tensors={"bb": poke(-1.0)}), "bb holds a negative value"),
    "nan_logits": (dict(tensors={"last_logits": poke(float("nan"))}), "last_logits holds NaN"),
    "short_pp": (dict(tensors={"pp": lambda t: t[:, :-1].contiguous()}), r"pp is F32 \(2, 63\)"),
    "half_pp": (dict(tensors={"pp": lambda t: t.half()}), "pp is F16"),
    "dtype_lies": (dict(metadata={"dtype": "float32"}), "aa is F16"),
    "missing_bb": (dict(tensors={"bb": None}), "tensors are"),
    "extra_tensor": (dict(tensors={"payload": torch.zeros(3)}), "tensors are"),
    "short_logits": (dict(tensors={"last_logits": lambda t: t[:-1].contiguous()}), "last_logits is F32"),
    "layers_header": (dict(metadata={"layers": "3"}), r"layers/hidden = \(3, 64\)"),
    "tokens_header": (dict(metadata={"tokens": "-4"}), "tokens = '-4' is not a count"),
    "unknown_dtype": (dict(metadata={"dtype": "int8"}), "dtype = 'int8'"),
    "format": (dict(metadata={"format": "astrai_pl.session"}), "is not a saved RWKV state"),
    "version": (dict(metadata={"version": "0"}), "version '0' of the state layout"),
}


@pytest.mark.parametrize("case", TAMPERED, ids=str)
def test_tampered_files_are_refused_naming_the_field(saved, tmp_path, case):
    model, path = saved
    edits, message = TAMPERED[case]
    bad = rewrite(path, tmp_path / f"{case}.safetensors", **edits)
    with pytest.raises(SessionError, match=message) as refused:
        StateSession.load(bad, model)
    assert str(bad) in str(refused.value)


def test_another_models_state_is_refused(saved, tmp_path):
    _, path = saved
    with pytest.raises(SessionError, match="different model"):
        StateSession.load(path, rwkv_model(seed=1))  # same shapes, other weights
    with pytest.raises(SessionError, match="different model"):
        StateSession.load(path, rwkv_model(num_hidden_layers=3))


def test_truncated_and_foreign_files_are_refused(saved, tmp_path):
    _, path = saved
    model = saved[0]
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(SessionError, match="not a readable state file"):
        StateSession.load(truncated, model)
    with pytest.raises(FileNotFoundError):
        StateSession.load(tmp_path / "absent.safetensors", model)


class _Marker:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickle_is_never_unpickled(saved, tmp_path):
    bad = tmp_path / "state.pt"
    bad.write_bytes(pickle.dumps({"aa": _Marker(tmp_path / "pickle-ran")}))
    with pytest.raises(SessionError, match="not a readable state file"):
        StateSession.load(bad, saved[0])
    assert not (tmp_path / "pickle-ran").exists()


def test_a_state_too_large_for_float16_is_not_saved_as_inf(tmp_path):
    chat = StateSession.warm(rwkv_model(), [5, 6]).scale("ffn_shift", 1e6)
    with pytest.raises(SessionError, match="ffn_shift is not finite in float16"):
        chat.save(tmp_path / "big", dtype=torch.float16)
    assert not (tmp_path / "big").exists()
    with pytest.raises(ValueError, match="torch.float16 or torch.bfloat16"):
        chat.save(tmp_path / "x", dtype=torch.int8)
