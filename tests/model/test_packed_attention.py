"""Packed rows without a dense mask: FlexAttention's document block mask and flash-attn's varlen entry give the
logits and gradients of each document run alone, with sliding windows and soft-capped scores too; the run-time
choice falls back (one log line) where a kernel cannot run."""

import logging

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
import torch.nn.functional as F

from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model import packed_attention as packed
from astrai_pl.model.attention import AttentionMask, dense_visibility
from astrai_pl.model.gemma import softcap

LENGTHS = [(5, 11, 4), (13, 7)]  # two rows of 20 tokens; the 11- and 13-token documents outrun gemma2's window of 8


@pytest.fixture(autouse=True)
def _run_time_choice():
    yield
    packed.override_packed_attention(None)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """torch refuses FlexAttention's backward on CPU by a device check; lifted, its reference backward runs. Dynamo
    starts afresh: after other flex calls in the process (the paged prefill's tests) it traces this one with dynamic
    shapes, and torch 2.13 cannot trace a soft-capping score_mod's backward that way (an unbacked symbol)."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(packed, "flex_has_backward", lambda device: True)


def packed_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(0, 320, (n,), generator=g) for n in row] for row in LENGTHS]
    ids = torch.stack([torch.cat(row) for row in docs])
    document_ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in LENGTHS])
    return docs, ids, document_ids


def grads_and_logits(model, ids, document_ids, docs, weights):
    """Parameter gradients of Σ logits·weights over the packed rows, and over each document run alone."""
    model.zero_grad()
    packed_logits = model(ids, document_ids=document_ids).logits  # (B, T, V)
    (packed_logits * weights).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone, start = [], 0
    for b, row in enumerate(docs):
        start = 0
        pieces = []
        for doc in row:
            logits = model(doc[None]).logits[0]  # (n, V)
            (logits * weights[b, start:start + len(doc)]).sum().backward()
            pieces.append(logits.detach())
            start += len(doc)
        alone.append(torch.cat(pieces))
    alone_grads = [p.grad.clone() for p in model.parameters()]
    return packed_logits.detach(), torch.stack(alone), packed_grads, alone_grads


GEMMA2 = dict(attn_logit_softcapping=0.5)  # gemma2-debug: a window of 8; a cap of 0.5 bends its small scores
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("preset", ["debug", "gemma2-debug"])
def test_packed_rows_equal_each_document_alone(preset, backend, flex_backward_on_cpu, monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(preset, **(GEMMA2 if preset == "gemma2-debug" else {})))
    docs, ids, document_ids = packed_batch()
    weights = torch.randn(ids.shape + (model.config.vocab_size,))
    packed.override_packed_attention(backend)
    kernels = []
    monkeypatch.setattr(packed.PackedRows, "_flex", _spy(packed.PackedRows._flex, kernels))
    logits, alone, grads, alone_grads = grads_and_logits(model, ids, document_ids, docs, weights)
    assert len(kernels) == (model.config.num_hidden_layers if backend == "flex" else 0)
    torch.testing.assert_close(logits, alone, atol=2e-5, rtol=1e-4)
    for got, want in zip(grads, alone_grads):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def _spy(method, calls: list):
    def spied(self, *args, **kwargs):
        calls.append(self.backend)
        return method(self, *args, **kwargs)

    return spied


def test_flex_logits_without_gradients_run_on_cpu_as_shipped():
    """No patch: torch's FlexAttention forward runs on CPU (evaluation, inference under no_grad)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("gemma2-debug", **GEMMA2)).eval()
    docs, ids, document_ids = packed_batch(1)
    packed.override_packed_attention("flex")
    with torch.no_grad():
        mask = AttentionMask.build(document_ids, ids.shape[1], dtype=torch.float32)
        logits = model(ids, document_ids=document_ids).logits
        alone = torch.stack([torch.cat([model(d[None]).logits[0] for d in row]) for row in docs])
    assert mask.packed is not None and mask.packed.backend == "flex"
    torch.testing.assert_close(logits, alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend,dtype,line", [
    ("flex", torch.float32, "packed attention flex → sdpa falls back (FlexAttention has no backward on CPU)"),
    ("varlen", torch.bfloat16, "packed attention varlen falls back (flash-attn needs CUDA, bf16/fp16 and the "
                               "`flash` extra)"),
])
def test_a_forced_kernel_that_cannot_run_on_cpu_falls_back_to_the_dense_mask(backend, dtype, line, caplog,
                                                                              monkeypatch):
    monkeypatch.setattr(packed, "_logged", set())
    packed.override_packed_attention(backend)
    _, ids, document_ids = packed_batch()
    with caplog.at_level(logging.INFO, logger="astrai_pl"):
        for _ in range(2):  # one line, however often
            mask = AttentionMask.build(document_ids, ids.shape[1], dtype=dtype)
    assert mask.packed is None and mask.mask is not None  # dense (B, 1, T, T)
    torch.testing.assert_close(mask.mask, dense_visibility(document_ids, None, ids.shape[1]))
    assert [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()] == [f"astrai_pl: {line}"]


def test_cpu_default_is_the_dense_mask():
    _, ids, document_ids = packed_batch()
    assert packed.packed_backend(torch.device("cpu"), torch.bfloat16, True) == "sdpa"
    assert AttentionMask.build(document_ids, ids.shape[1]).packed is None


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="sdpa, flex, varlen"):
        packed.override_packed_attention("flash")


def test_document_starts_are_the_cu_seqlens_of_the_flattened_rows():
    _, _, document_ids = packed_batch()
    assert packed.document_starts(document_ids).tolist() == [0, 5, 16, 20, 33, 40]
    same_id_across_rows = torch.zeros(2, 4, dtype=torch.long)  # each row starts a document of its own
    assert packed.document_starts(same_id_across_rows).tolist() == [0, 4, 8]


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal, window_size, softcap):
    """What flash_attn_varlen_func computes, document by document, on (total, H, D) inputs."""
    assert causal and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    out = torch.empty_like(q)
    bounds = cu_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], 0) for t in (ks, vs))
        i = torch.arange(end - start)
        left = window_size[0] if window_size[0] >= 0 else end - start
        visible = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= left)
        scores = (qs @ ks.transpose(-1, -2)) * (softmax_scale or q.shape[-1] ** -0.5)
        scores = softcap_scores(scores, softcap).masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def softcap_scores(scores, cap):
    return softcap(scores, cap) if cap else scores


@pytest.mark.parametrize("window,cap,scale", [(None, None, None), (3, None, None), (4, 20.0, 0.3)])
def test_varlen_layout_equals_the_dense_mask(window, cap, scale, monkeypatch):
    """The varlen call (rows flattened, cu_seqlens, window, soft-cap) with a per-document stand-in for
    flash-attn, against the dense mask on the same q, k, v."""
    monkeypatch.setattr(packed, "_flash_varlen", lambda: varlen_reference)
    torch.manual_seed(0)
    _, ids, document_ids = packed_batch()
    B, T = ids.shape
    q, k, v = torch.randn(B, 4, T, 8), torch.randn(B, 2, T, 8), torch.randn(B, 2, T, 8)
    got = packed.PackedRows(document_ids, "varlen").attend(q, k, v, window=window, scale=scale, softcap=cap)
    mask = AttentionMask(dense_visibility(document_ids, None, T), T).for_window(window)
    scores = softcap_scores((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * (scale or 8**-0.5), cap)
    want = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_packed_kernels_on_cuda_equal_the_dense_mask(backend):
    if backend == "varlen" and not packed.flash_varlen_available():
        pytest.skip("flash-attn is not installed")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("gemma2-debug", **GEMMA2)).cuda()
    _, ids, document_ids = packed_batch()
    ids, document_ids = ids.cuda(), document_ids.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        packed.override_packed_attention("sdpa")
        want = model(ids, document_ids=document_ids).logits.float()
        packed.override_packed_attention(backend)
        got = model(ids, document_ids=document_ids).logits.float()
    assert F.mse_loss(got, want) < 1e-3
