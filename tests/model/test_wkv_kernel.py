"""The fused WKV kernels (astrai_pl.ops.wkv) against the PyTorch loop and the float64 plain recurrence."""

from __future__ import annotations

import pytest
import torch
from test_rwkv import _inputs

from astrai_pl.model.rwkv import wkv, wkv_reference
from astrai_pl.ops import cpu
from astrai_pl.ops import wkv as wkv_kernel

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no fused CPU kernels here: {cpu.unavailable_reason()}")


def _grads(fn, inputs, weights, dtype=torch.float32):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
    out, state = fn(*leaves)
    (out * weights.to(dtype)).sum().backward()
    return out.detach(), state, [t.grad for t in leaves]


def _loop(*inputs, **kwargs):
    with cpu.override_available(False):
        return wkv(*inputs, **kwargs)


@pytest.mark.parametrize("shape", [(2, 7, 4), (3, 33, 70), (1, 200, 128)])
def test_kernel_values_and_gradients_equal_the_float64_recurrence(shape):
    inputs = _inputs(*shape)
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    out, state, grads = _grads(wkv, inputs, weights)
    ref, _, ref_grads = _grads(wkv_reference, inputs, weights, torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for name, ours, theirs in zip("wukv", grads, ref_grads):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-4, msg=name)


def test_kernel_is_the_path_taken_and_equals_the_loop():
    inputs = _inputs(2, 40, 96)
    assert wkv_kernel.usable(*inputs, None)
    weights = torch.randn(2, 40, 96, generator=torch.Generator().manual_seed(1))
    fused = _grads(wkv, inputs, weights)
    loop = _grads(_loop, inputs, weights)
    torch.testing.assert_close(fused[0], loop[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(fused[1], loop[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused[2], loop[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_kernel_continues_from_a_state_and_resets_at_document_starts():
    w, u, k, v = _inputs(2, 24, 16)
    _, start = _loop(w, u, k[:, :5], v[:, :5])
    resets = torch.zeros(2, 19, dtype=torch.bool)
    resets[0, 6] = resets[1, 11] = True
    fused, fused_state = wkv(w, u, k[:, 5:], v[:, 5:], start, resets=resets)
    loop, loop_state = _loop(w, u, k[:, 5:], v[:, 5:], start, resets=resets)
    torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_state, loop_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_gradient_crosses_a_document_start():
    w, u, k, v = (t.requires_grad_() for t in _inputs(1, 12, 8))
    resets = torch.zeros(1, 12, dtype=torch.bool)
    resets[0, 5] = True
    out, _ = wkv(w, u, k, v, resets=resets)
    out[:, 5:].sum().backward()  # only the second document's outputs
    assert k.grad[:, :5].abs().max() == 0 and v.grad[:, :5].abs().max() == 0
    assert k.grad[:, 5:].abs().min() > 0


def test_kernel_gradients_stay_finite_where_the_plain_sums_overflow_float32():
    inputs = list(_inputs(2, 64, 8, k_scale=1.0))
    inputs[2] = inputs[2] + 90.0  # e^{90} is inf in float32
    weights = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(2))
    out, _, grads = _grads(wkv, inputs, weights)
    ref, _, ref_grads = _grads(wkv_reference, inputs, weights, torch.float64)
    torch.testing.assert_close(out, _loop(*inputs)[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)  # float32's k ~ 90: ulp 8e-6 in an exponent
    for name, ours, theirs in zip("wukv", grads, ref_grads):
        assert torch.isfinite(ours).all(), name
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-3, atol=1e-3, msg=name)


def test_a_start_state_that_wants_gradients_keeps_the_loop():
    w, u, k, v = _inputs(1, 6, 4)
    _, start = _loop(w, u, k, v)
    start = tuple(s.clone().requires_grad_() for s in start)
    assert not wkv_kernel.usable(w, u, k, v, start)
    out, _ = wkv(w, u, k, v, start)
    out.sum().backward()
    assert all(s.grad is not None for s in start)  # the loop differentiates the start state


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 7, 4), (3, 300, 160)])
def test_cuda_kernel_equals_the_cpu_kernel_values_gradients_and_state(shape):
    inputs = _inputs(*shape)
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    resets = torch.zeros(shape[:2], dtype=torch.bool)
    resets[0, shape[1] // 2] = True
    on_gpu = [t.cuda() for t in inputs]
    assert wkv_kernel.usable(*on_gpu, None)
    cpu_out = _grads(lambda *t: wkv(*t, resets=resets), inputs, weights)
    gpu_out = _grads(lambda *t: wkv(*t, resets=resets.cuda()), on_gpu, weights.cuda())
    torch.testing.assert_close(gpu_out[0].cpu(), cpu_out[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(gpu_out[1], cpu_out[1]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)
    for name, a, b in zip("wukv", gpu_out[2], cpu_out[2]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-3, atol=1e-4, msg=name)
