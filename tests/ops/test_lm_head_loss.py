"""The fused lm_head + loss on its GPU paths, held to the reference on CPU: the weight gradient accumulated in
place in float32, chunks sized by the device, Liger-Kernel's kernel behind a flag with a fallback."""

import logging

import pytest
import torch
import torch.nn.functional as F

from astrai_pl.objectives.losses import IGNORE_INDEX, cross_entropy, linear_cross_entropy
from astrai_pl.ops import lm_head_loss


@pytest.fixture(autouse=True)
def _run_time_choice(monkeypatch):
    monkeypatch.setattr(lm_head_loss, "_logged", set())
    yield
    lm_head_loss.override_lm_head_loss(None)
    lm_head_loss.override_weight_grad_accumulation(None)


def case(rows=(2, 9), hidden=16, vocab=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*rows, hidden, generator=gen).requires_grad_(True)
    w = (3 * torch.randn(vocab, hidden, generator=gen)).requires_grad_(True)
    labels = torch.randint(0, vocab, rows, generator=gen)
    labels[0, :4] = IGNORE_INDEX
    labels[1, -2:] = IGNORE_INDEX
    return h, w, labels


def float64_reference(h, w, labels, smoothing):
    """Loss and gradients in float64 of the bf16-rounded operands and logits (the rounding passes gradients as
    they are): what bf16 matmuls with float32 softmax and sums approach."""
    h64 = h.detach().bfloat16().double().requires_grad_(True)
    w64 = w.detach().bfloat16().double().requires_grad_(True)
    logits = h64 @ w64.t()
    logits = logits + (logits.bfloat16().double() - logits).detach()
    loss = cross_entropy(logits, labels, label_smoothing=smoothing)[0]
    return loss, torch.autograd.grad(loss, (h64, w64))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1, 4, 256])
def test_in_place_float32_accumulation_equals_the_reference_under_bf16_autocast(chunk_size, smoothing, monkeypatch):
    h, w, labels = case()
    modes = []
    real = lm_head_loss.matmul_into
    monkeypatch.setattr(lm_head_loss, "matmul_into", lambda out, a, b, mode, add: modes.append(mode) or
                        real(out, a, b, mode, add=add))
    lm_head_loss.override_weight_grad_accumulation("upcast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, labels, label_smoothing=smoothing, chunk_size=chunk_size)[0]
    grads = torch.autograd.grad(loss, (h, w))
    want, want_grads = float64_reference(h, w, labels, smoothing)
    assert set(modes) == {"upcast"} and len(modes) == 2 * -(-12 // chunk_size)  # hidden and weight, each chunk
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, want_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=2e-3)  # bf16 logit gradients


def test_every_accumulation_gives_one_loss_and_close_gradients():
    h, w, labels = case(rows=(3, 40), vocab=50)
    results = {}
    for mode in ("sum", "upcast"):
        lm_head_loss.override_weight_grad_accumulation(mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(h, w, labels, chunk_size=8)[0]
        results[mode] = (loss, torch.autograd.grad(loss, (h, w)))
    assert torch.equal(results["sum"][0], results["upcast"][0])  # the forward does not depend on it
    for summed, in_place in zip(results["sum"][1], results["upcast"][1]):  # bf16 products against float32 ones
        torch.testing.assert_close(summed, in_place, rtol=2e-2, atol=2e-3)


def test_cpu_defaults_are_unchanged():
    assert lm_head_loss.accumulation(torch.device("cpu")) == "sum"
    assert lm_head_loss.chunk_rows(torch.device("cpu"), 128_256) == 256
    assert lm_head_loss.loss_kernel(torch.device("cpu"), 0.0) == "chunked"


def test_cuda_chunks_hold_one_gibibyte_of_float32_logits():
    assert lm_head_loss.chunk_rows(torch.device("cuda"), 128_256) == 2048  # Llama 3
    assert lm_head_loss.chunk_rows(torch.device("cuda"), 151_936) == 1536  # Qwen 2.5
    assert lm_head_loss.chunk_rows(torch.device("cuda"), 4_000_000) == 256  # never below the CPU size


def test_forced_choices_that_cannot_run_fall_back_with_one_log_line(caplog):
    lm_head_loss.override_weight_grad_accumulation("out_dtype")
    lm_head_loss.override_lm_head_loss("liger")
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="astrai_pl"):
        assert lm_head_loss.accumulation(cpu) == "upcast" and lm_head_loss.accumulation(cpu) == "upcast"
        assert lm_head_loss.loss_kernel(cpu, 0.0) == "chunked" and lm_head_loss.loss_kernel(cpu, 0.0) == "chunked"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["astrai_pl: lm_head loss out_dtype accumulation falls back (out_dtype matmuls run on CUDA only)",
                     "astrai_pl: lm_head loss liger falls back (Liger-Kernel needs CUDA and the `gpu` extra)"]


def test_unknown_choices_are_refused():
    with pytest.raises(ValueError, match="chunked, liger"):
        lm_head_loss.override_lm_head_loss("cce")
    with pytest.raises(ValueError, match="sum, out_dtype, upcast"):
        lm_head_loss.override_weight_grad_accumulation("fp32")


def liger_stand_in(rows, weight, targets, reduction):
    """Liger's functional entry as our call uses it: summed CE of rows @ weightᵀ, -100 ignored."""
    assert reduction == "sum" and rows.dtype == weight.dtype
    return F.cross_entropy((rows @ weight.t()).float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_liger_path_sums_the_trained_rows_and_keeps_the_metrics(smoothing, monkeypatch):
    monkeypatch.setattr(lm_head_loss, "liger_runs_on", lambda device: True)
    monkeypatch.setattr(lm_head_loss, "_liger_loss", lambda: liger_stand_in)
    lm_head_loss.override_lm_head_loss("liger")
    h, w, labels = case()
    assert lm_head_loss.loss_kernel(h.device, smoothing) == ("chunked" if smoothing else "liger")
    loss, metrics = linear_cross_entropy(h, w, labels, label_smoothing=smoothing)
    lm_head_loss.override_lm_head_loss(None)
    want, want_metrics = linear_cross_entropy(h, w, labels, label_smoothing=smoothing)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(metrics["nll"], want_metrics["nll"])
    assert metrics["tokens"] == want_metrics["tokens"] == 12
    for got, expected in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(got, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel,mode", [("chunked", "out_dtype"), ("chunked", "sum"), ("liger", None)])
def test_cuda_paths_equal_the_upcast_accumulation(kernel, mode):
    if kernel == "liger" and not lm_head_loss.liger_available():
        pytest.skip("Liger-Kernel is not installed")
    h, w, labels = (t.cuda() for t in case(rows=(4, 300), hidden=64, vocab=1000))
    h, w = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    results = []
    for k, m in ((kernel, mode), ("chunked", "upcast")):
        lm_head_loss.override_lm_head_loss(k)
        lm_head_loss.override_weight_grad_accumulation(m)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(h, w, labels.cuda(), chunk_size=256)[0]
        results.append((loss, *torch.autograd.grad(loss, (h, w))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
