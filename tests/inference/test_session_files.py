"""Saved sessions are untrusted files: everything read is checked, a refused file leaves no page behind,
and the model fingerprint covers every byte of every weight."""

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from astrai_pl.inference import SamplingParams, SessionError

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def saved_session(engine, path, prompt, prefill_only=False):
    chat = engine.session()
    chat.generate(prompt, SamplingParams(max_tokens=0) if prefill_only else GREEDY)
    chat.save(path)
    chat.close()
    return path


def rewrite(path, out, tensors=None, metadata=None):
    """Copy a session file with some tensors or metadata entries replaced (None drops an entry)."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        data = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for updates, target in ((tensors or {}, data), (metadata or {}, meta)):
        for name, value in updates.items():
            value = value(target[name]) if callable(value) else value
            if value is None:
                target.pop(name)
            else:
                target[name] = value
    save_file(data, str(out), metadata=meta)
    return out


def poke(index, value):
    def edit(t):
        t = t.clone()
        t.view(-1)[index] = value
        return t

    return edit


TAMPERED = {
    "token_outside_vocab": dict(tensors={"tokens": poke(3, 9999)}),
    "negative_token": dict(tensors={"tokens": poke(0, -5)}),
    "float_tokens": dict(tensors={"tokens": lambda t: t.float()}),
    "nan_k": dict(tensors={"k": poke(7, float("nan"))}),
    "inf_v": dict(tensors={"v": poke(0, float("inf"))}),
    "short_k": dict(tensors={"k": lambda t: t[:, :-1].contiguous()}),  # fails after pages were taken before
    "missing_v": dict(tensors={"v": None}),
    "extra_tensor": dict(tensors={"payload": torch.zeros(3)}),
    "short_logits": dict(tensors={"last_logits": lambda t: t[:-1].contiguous()}),
    "nan_logits": dict(tensors={"last_logits": poke(0, float("nan"))}),
    "negative_num_computed": dict(metadata={"num_computed": "-1"}),
    "text_num_computed": dict(metadata={"num_computed": "ten"}),
    "too_many_computed": dict(metadata={"num_computed": "999"}),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_tampered_session_file_is_refused_and_leaves_the_pool_as_it_was(
    case, model, make_engine, reference_greedy, random_prompts, tmp_path
):
    prompt, probe = random_prompts([13, 6], seed=51)
    engine = make_engine(model, page_size=4)
    good = saved_session(engine, tmp_path / "good.safetensors", prompt, prefill_only="logits" in case)
    bad = rewrite(good, tmp_path / "bad.safetensors", **TAMPERED[case])
    before = engine.check()
    with pytest.raises(SessionError, match=r"bad\.safetensors.*save the session again"):
        engine.load_session(bad)
    assert engine.check() == before and not engine.sessions
    [out] = engine.generate([probe], GREEDY)
    assert out.token_ids == reference_greedy(model, probe, 6)
    engine.load_session(good).close()  # the untouched file still loads
    assert engine.check().in_use == 0


@pytest.mark.parametrize(
    "content", [b"", b"\x00" * 64, b"not a safetensors file at all", bytes(range(256)) * 8]
)
def test_a_garbage_session_file_is_refused_with_its_path(content, model, make_engine, tmp_path):
    engine = make_engine(model, page_size=4)
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(content)
    with pytest.raises(SessionError, match=r"garbage\.safetensors is not a readable session file"):
        engine.load_session(path)
    assert engine.check().in_use == 0


def test_a_weight_changed_anywhere_changes_the_fingerprint(model, make_engine, random_prompts, tmp_path):
    engine = make_engine(model, page_size=4)
    path = saved_session(engine, tmp_path / "chat.safetensors", random_prompts([9], seed=52)[0])
    changed = copy.deepcopy(model)
    with torch.no_grad():  # index 1 of a 20480-value tensor: between the points a strided sample reads
        changed.embed_tokens.weight.view(-1)[1] += 1e-3
    with pytest.raises(SessionError, match="different model"):
        make_engine(changed, page_size=4).load_session(path)


def test_the_cached_fingerprint_follows_weight_changes(model, make_engine, random_prompts, tmp_path):
    policy = copy.deepcopy(model)
    engine = make_engine(policy, page_size=4)
    path = saved_session(engine, tmp_path / "chat.safetensors", random_prompts([9], seed=53)[0])
    engine.load_session(path).close()
    weight = policy.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        weight.view(-1)[5] += 1e-3  # in place: the version counter moves
    with pytest.raises(SessionError, match="different model"):
        engine.load_session(path)
    with torch.no_grad():
        weight.data.view(-1)[5] -= 1e-3  # through .data: no version counter moves, weights_changed() says so
    engine.weights_changed()
    engine.load_session(path).close()
    assert engine.check().in_use == 0
