"""The fused CPU kernels against the model's eager PyTorch code, and their fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.layers import RMSNorm, SwiGLU, apply_rotary
from astrai_pl.ops import cpu

# Every test but the fallback ones needs the library built (a C compiler with OpenMP).
needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"no fused CPU kernels here: {cpu.unavailable_reason()}")


def eager_and_fused(fn, *inputs):
    """fn's outputs and the gradients of every input, with the kernels off and on."""
    results = []
    for state in (False, None):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        with cpu.override_available(state):
            out = fn(*leaves)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), [t.grad for t in leaves if t.requires_grad]))
    return results


@needs_kernels
@pytest.mark.parametrize("shape", [(4, 16, 64), (3, 7), (1, 1, 1, 13), (2, 5, 512)])
def test_rms_norm_matches_eager_values_and_gradients(shape):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], eps=1e-5)
    x = (3 * torch.randn(shape)).requires_grad_()
    w = (1 + 0.5 * torch.randn(shape[-1])).requires_grad_()

    (y0, (gx0, gw0)), (y1, (gx1, gw1)) = eager_and_fused(lambda x, w: _with(norm, w)(x), x, w)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw1, gw0, rtol=1e-4, atol=1e-4)


def _with(norm: RMSNorm, weight: torch.Tensor) -> RMSNorm:
    """`norm` computing with `weight` (a leaf of the test's graph) in place of its parameter."""
    del norm.weight
    norm.weight = weight
    return norm


@needs_kernels
@pytest.mark.parametrize("dense", [False, True])  # rows 64 apart (copied first); a decode step's dense rows
def test_rms_norm_takes_a_non_contiguous_input_and_runs_without_autograd(dense):
    torch.manual_seed(1)
    norm = RMSNorm(32)
    with torch.no_grad():
        norm.weight.mul_(1 + 0.5 * torch.randn(32))
    x = torch.randn(1, 6, 32) if dense else torch.randn(6, 64)[:, :32]
    assert cpu.rms_norm_usable(x, norm.weight)
    with torch.inference_mode():
        fused = norm(x)
        with cpu.override_available(False):
            eager = norm(x)
    assert fused.shape == x.shape and fused.is_contiguous()
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("heads,sliced", [(8, False), (2, True), (1, False)])
def test_rotary_matches_eager_values_and_gradients(heads, sliced):
    torch.manual_seed(2)
    B, T, D = 2, 9, 16
    angles = torch.randn(B, T, D // 2)
    emb = torch.cat([angles, angles], -1)
    cos, sin = 1.3 * emb.cos(), 1.3 * emb.sin()  # an attention factor, as YaRN scales them
    width = heads + 3 if sliced else heads  # sliced: q taken out of a joined q/k/v projection, rows apart
    base = torch.randn(B, T, width, D).requires_grad_()

    def fn(base):
        x = base[:, :, :heads]
        assert x.is_contiguous() != sliced
        return apply_rotary(x, cos, sin)

    assert cpu.rotary_usable(base[:, :, :heads], cos, sin)

    (y0, (g0,)), (y1, (g1,)) = eager_and_fused(fn, base)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-6)


def test_unusable_inputs_take_the_eager_path():
    x, w = torch.randn(2, 4, 8), torch.ones(8)
    assert not cpu.rms_norm_usable(x.double(), w.double())
    assert not cpu.rms_norm_usable(x.bfloat16(), w)
    assert not cpu.rms_norm_usable(x, torch.ones(4))
    q, cos = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 8)
    assert not cpu.rotary_usable(q.bfloat16(), cos, cos)
    assert not cpu.rotary_usable(q.transpose(1, 2), cos, cos)  # heads before positions
    assert not cpu.rotary_usable(q, cos[:1], cos[:1])  # broadcast positions: eager
    with cpu.override_available(False):
        assert not cpu.rms_norm_usable(x, w) and cpu.unavailable_reason() == "turned off by override_available(False)"


@needs_kernels
def test_a_model_trains_the_same_with_and_without_the_kernels():
    """Two training steps of the debug model: losses and every gradient agree to float32 round-off."""
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    runs = []
    for state in (False, None):
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_name("debug"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        with cpu.override_available(state):
            for _ in range(2):
                logits = model(ids).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        runs.append((losses, grads))
    (l0, g0), (l1, g1) = runs
    assert l1 == pytest.approx(l0, rel=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-3, atol=1e-5, msg=name)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_turned_off_by_the_environment_or_without_a_compiler_the_reason_is_given(tmp_path):
    code = "from astrai_pl.ops import cpu; print(cpu.available(), '|', cpu.unavailable_reason())"
    off = run_python(code, ASTRAI_CPU_KERNELS="0")
    assert off.stdout.strip() == "False | turned off by ASTRAI_CPU_KERNELS=0", off.stderr
    no_cc = run_python(code, PATH=str(tmp_path), CC="", ASTRAI_CACHE_DIR=str(tmp_path / "cache"), ASTRAI_CPU_KERNELS="1")
    assert no_cc.stdout.strip() == "False | no C compiler found (set CC, or install gcc)", no_cc.stderr


@needs_kernels
def test_a_failed_build_names_the_source_and_leaves_no_library(tmp_path, monkeypatch):
    broken = tmp_path / "cpu_kernels.c"
    broken.write_text("this is not C;\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(cache))
    monkeypatch.setattr(cpu, "SOURCE", broken)
    with pytest.raises(RuntimeError, match=r"compiling cpu_kernels\.c with .* failed"):
        cpu._build()
    assert list(cache.iterdir()) == []  # neither a library nor a half-written temporary


@needs_kernels
def test_the_build_is_cached_under_a_name_that_changes_with_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(tmp_path))
    cpu._build()
    first = sorted(p.name for p in tmp_path.iterdir())
    assert len(first) == 1 and first[0].startswith("cpu_kernels-") and first[0].endswith(".so")
    cpu._build()  # found, not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == first
    changed = tmp_path / "src" / "cpu_kernels.c"
    changed.parent.mkdir()
    changed.write_text(cpu.SOURCE.read_text() + "\n/* another version */\n")
    monkeypatch.setattr(cpu, "SOURCE", changed)
    cpu._build()
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".so"]) == 2


@needs_kernels
@pytest.mark.parametrize("sliced", [False, True])
def test_swiglu_matches_eager_values_and_gradients(sliced):
    """silu(gate)·up, gate and up apart or as the two halves of one joined gate/up output."""
    torch.manual_seed(4)
    joined = (4 * torch.randn(3, 5, 2 * 24)).requires_grad_()  # wide range: exp's tails included

    def fn(joined):
        gate, up = joined.split(24, dim=-1) if sliced else (joined[..., :24].contiguous(), joined[..., 24:] * 1.0)
        return SwiGLU.activation(gate, up)

    assert cpu.swiglu_usable(*joined.split(24, dim=-1))
    (y0, (g0,)), (y1, (g1,)) = eager_and_fused(fn, joined)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)


@needs_kernels
def test_swiglu_at_the_ends_of_exp():
    gate = torch.tensor([[-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4]])
    up = torch.ones_like(gate)
    with torch.no_grad():
        fused = cpu.swiglu(gate, up)
    torch.testing.assert_close(fused, torch.nn.functional.silu(gate), rtol=1e-6, atol=1e-30)


@needs_kernels
def test_outputs_can_be_changed_in_place_and_torch_func_takes_the_eager_path():
    norm, x = RMSNorm(8), torch.randn(3, 8, requires_grad=True)
    for out in (norm(x), SwiGLU.activation(x, 2 * x)):  # not views of a tensor made inside the Function
        out.add_(1).sum().backward()
    batch = torch.randn(4, 3, 8)
    with torch.no_grad():  # vmap's tensors have no storage of their own: eager PyTorch runs them
        torch.testing.assert_close(torch.func.vmap(norm)(batch), norm(batch))
    row = batch[0].clone().requires_grad_()
    grad = torch.func.grad(lambda t: norm(t).sum())(row)
    torch.testing.assert_close(grad, torch.autograd.grad(norm(row).sum(), row)[0])


@needs_kernels
def test_panel_matmul_takes_empty_inputs_and_leaves_autocast_to_pytorch():
    from astrai_pl.model.layers import InputMajorWeights, Linear

    linear, weights = Linear(16, 8), InputMajorWeights()
    with torch.no_grad(), Linear.input_major(weights):
        assert linear(torch.randn(0, 16)).shape == (0, 8)
        assert weights.get(linear.weight).dim() == 3  # panels
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert linear(torch.randn(4, 16)).dtype == torch.bfloat16  # autocast's matmul, as F.linear
    with torch.no_grad():
        assert cpu.panel_matmul(torch.randn(0, 16), weights.get(linear.weight), 8).shape == (0, 8)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 16, 64])
# one block of k; three, the last ragged (K_BLOCK 128); fewer than the 4 k steps a tile takes at a time; 4s and 3 over
@pytest.mark.parametrize("inputs", [40, 128 * 2 + 13, 3, 128 + 7])
def test_panel_matmul_matches_linear_for_every_tile_and_a_ragged_last_panel(rows, inputs):
    """Every tile height (1-6 rows, then blocks of 6) and width, a last panel of 8 + 29 columns, and inputs
    summed over several k-blocks (each block's partial sums carried into the next)."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(2 * 64 + 37, inputs, generator=g), torch.randn(rows, inputs, generator=g)
    panels = cpu.pack_panels([w], torch.zeros(cpu.panels_shape(w.shape[0], w.shape[1])))
    torch.testing.assert_close(cpu.panel_matmul(x, panels, w.shape[0]), x @ w.t(), atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"),
                         [(8, 2, 64), (9, 3, 64), (4, 4, 24), (12, 2, 40), (4, 2, 128)])  # G = 4, 3, 1, 6, 2
def test_paged_decode_attention_matches_the_reference(num_q_heads, num_kv_heads, head_dim):
    from paged_cases import paged_case

    from astrai_pl.ops import reference

    kv_lens = [1, 7, 300, 64, 9, 17]  # one key; fewer than the 8 keys scored together; ragged tails
    case = paged_case([1] * len(kv_lens), kv_lens, num_q_heads, num_kv_heads, head_dim, seed=5)
    assert cpu.paged_decode_attention_usable(case.q, case.k_pool, case.v_pool)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    out = cpu.paged_decode_attention(case.q, case.k_pool, case.v_pool, case.req_to_token, case.rows, lens,
                                     max(kv_lens))
    ref = reference.paged_decode_ref(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    with cpu.override_available(False):
        assert not cpu.paged_decode_attention_usable(case.q, case.k_pool, case.v_pool)
    assert not cpu.paged_decode_attention_usable(case.q[..., :20], case.k_pool[..., :20], case.v_pool[..., :20])


def test_importing_the_package_makes_openmp_threads_sleep_unless_told_otherwise():
    """OMP_WAIT_POLICY defaults to PASSIVE when astrai_pl is imported before torch; a set value stays."""
    import os
    import subprocess
    import sys

    script = "import astrai_pl, os; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", script], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ACTIVE"
