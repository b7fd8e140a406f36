"""Attention over the pool equals the no-cache forward; backend selection by env, context manager, priority."""

import threading

import pytest
import torch

from astrai_pl.inference import BackendUnavailable
from astrai_pl.inference.attention import StepView, attn_backend, select_backend, torch_backend
from astrai_pl.inference.attention.cuda_backend import CudaBackend
from astrai_pl.inference.attention.torch_backend import TorchBackend
from astrai_pl.inference.cache import KVStorage, ReqToTokenPool
from astrai_pl.inference.pool import KVPool
from astrai_pl.ops import cpu as cpu_ops

CPU = torch.device("cpu")


def make_pool(model, page_size: int) -> KVPool:
    cfg = model.config
    storage = KVStorage(
        cfg.num_hidden_layers, 64 * page_size, cfg.num_key_value_heads, cfg.head_size, torch.float32, CPU
    )
    return KVPool(storage, ReqToTokenPool(4, 256, CPU), page_size, prefix_cache=False)


@torch.no_grad()
def run_step(model, pool, segments, backend=None):
    """segments: (row, pages, tokens, start, n). Computes tokens[start:start+n] of each; logits per segment."""
    ids, positions, out_slots, rows, prefix, extend = [], [], [], [], [], []
    for row, pages, tokens, start, n in segments:
        need = pool.pages_for(start + n) - len(pages)
        pages.extend(pool.allocate(need) if need > 0 else [])
        slots = pool.slots(pages, 0, start + n)
        pool.req_to_token.write([row] * len(slots), list(range(start + n)), slots)
        ids += tokens[start : start + n]
        positions += range(start, start + n)
        out_slots += slots[start:]
        rows.append(row), prefix.append(start), extend.append(n)
    view = StepView.build(
        pool.storage,
        pool.req_to_token.table,
        backend or TorchBackend(),
        rows,
        prefix,
        extend,
        out_slots,
        pool.page_size,
    )
    hidden, _ = model.hidden_states(torch.tensor([ids]), position_ids=torch.tensor([positions]), cache=view)
    return model.lm_head(hidden[0]).split(extend)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("backend", [TorchBackend(), CudaBackend()], ids=["torch", "fused-api"])
def test_ragged_prefill_and_decode_logits_equal_the_no_cache_forward(
    model, random_prompts, page_size, backend
):
    """On CPU the fused-kernel backend runs astrai_pl.ops' references: this checks how it calls them."""
    pool = make_pool(model, page_size)
    a, b, c = random_prompts([13, 40, 7], seed=3)
    pages = {0: [], 1: [], 2: []}
    # step 1: all of a, the first chunk of b; step 2: a decodes one token, the rest of b, all of c
    a = a + [99]
    step1 = run_step(model, pool, [(0, pages[0], a, 0, 13), (1, pages[1], b, 0, 25)], backend)
    step2 = run_step(
        model, pool, [(0, pages[0], a, 13, 1), (1, pages[1], b, 25, 15), (2, pages[2], c, 0, 7)], backend
    )
    decode = run_step(model, pool, [(0, pages[0], a + [5], 14, 1), (2, pages[2], c + [6], 7, 1)], backend)
    with torch.no_grad():
        full = {name: model(torch.tensor([seq])).logits[0] for name, seq in (("a", a), ("b", b), ("c", c))}
    torch.testing.assert_close(step1[0], full["a"][:13], atol=1e-5, rtol=0)
    torch.testing.assert_close(step1[1], full["b"][:25], atol=1e-5, rtol=0)
    torch.testing.assert_close(step2[0], full["a"][13:], atol=1e-5, rtol=0)
    torch.testing.assert_close(step2[1], full["b"][25:], atol=1e-5, rtol=0)
    torch.testing.assert_close(step2[2], full["c"], atol=1e-5, rtol=0)
    with torch.no_grad():  # a decode-only step
        torch.testing.assert_close(
            decode[0], model(torch.tensor([a + [5]])).logits[0, -1:], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            decode[1], model(torch.tensor([c + [6]])).logits[0, -1:], atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_kernel_and_sdpa_share_a_step(model, random_prompts, page_size, monkeypatch):
    """On the CPU kernel every token of a step reads its context from the pool, except whole prompts longer than
    KERNEL_PROMPT_TOKENS (SDPA): a step mixing a decode, a chunk after a prefix and whole prompts on both sides of
    the limit, in an order that leaves the kernel's tokens apart, equals the no-cache forward."""
    if not cpu_ops.available():
        pytest.skip("the fused CPU kernels do not build here")
    monkeypatch.setattr(torch_backend, "KERNEL_PROMPT_TOKENS", 10)
    groups = []
    real = torch_backend._kernel_group
    monkeypatch.setattr(torch_backend, "_kernel_group", lambda view, members: groups.append(real(view, members))
                        or groups[-1])
    pool = make_pool(model, page_size)
    a, b, c = random_prompts([13, 25, 12], seed=5)
    pages = {0: [], 1: [], 2: []}
    a = a + [99]
    step1 = run_step(model, pool, [(0, pages[0], a, 0, 13), (1, pages[1], b, 0, 5)])  # SDPA, kernel
    step2 = run_step(model, pool, [(0, pages[0], a, 13, 1), (2, pages[2], c, 0, 12), (1, pages[1], b, 5, 20)])
    assert [None if g.q_index is None else g.q_index.tolist() for g in groups] == [[13, 14, 15, 16, 17],
                                                                                  [0, *range(13, 33)]]
    with torch.no_grad():
        full = {name: model(torch.tensor([seq])).logits[0] for name, seq in (("a", a), ("b", b), ("c", c))}
    torch.testing.assert_close(step1[0], full["a"][:13], atol=1e-5, rtol=0)
    torch.testing.assert_close(step1[1], full["b"][:5], atol=1e-5, rtol=0)
    torch.testing.assert_close(step2[0], full["a"][13:], atol=1e-5, rtol=0)
    torch.testing.assert_close(step2[1], full["c"], atol=1e-5, rtol=0)
    torch.testing.assert_close(step2[2], full["b"][5:], atol=1e-5, rtol=0)


def test_view_builds_indptrs_once_for_all_layers(model):
    pool = make_pool(model, 4)
    view = StepView.build(
        pool.storage, pool.req_to_token.table, TorchBackend(), [0, 1, 2], [5, 9, 0], [1, 1, 6], list(range(8))
    )
    assert view.qo_indptr.tolist() == [0, 1, 2, 8] and view.kv_indptr.tolist() == [0, 6, 16, 22]
    assert view.num_decode == 2
    calls = []
    backend = view.backend
    original = backend.prepare
    backend.prepare = lambda *args: calls.append(1) or original(*args)
    try:
        with torch.no_grad():
            model.hidden_states(
                torch.zeros(1, 8, dtype=torch.long),
                position_ids=torch.tensor([[5, 9, 0, 1, 2, 3, 4, 5]]),
                cache=view,
            )
    finally:
        del backend.prepare
    assert len(calls) == 1  # layer 0 made the metadata; layer 1 reused it


# -- selection -------------------------------------------------------------------------------------------------
def test_torch_is_chosen_on_cpu_and_env_overrides(monkeypatch):
    monkeypatch.delenv("ASTRAI_BACKEND", raising=False)
    assert select_backend(CPU, torch.float32).name == "torch"
    monkeypatch.setenv("ASTRAI_BACKEND", "torch")
    assert select_backend(CPU, torch.float32).name == "torch"
    monkeypatch.setenv("ASTRAI_BACKEND", "cuda")
    with pytest.raises(BackendUnavailable, match="ASTRAI_BACKEND.*CUDA only"):
        select_backend(CPU, torch.float32)
    monkeypatch.setenv("ASTRAI_BACKEND", "triton")
    with pytest.raises(ValueError, match="triton.*cuda, flash, torch"):
        select_backend(CPU, torch.float32)


@pytest.mark.parametrize(
    "name", [pytest.param("cuda", id="fused-kernels"), pytest.param("flash", id="flash-attn")]
)
def test_forcing_an_unavailable_backend_is_a_clear_error(name, monkeypatch):
    monkeypatch.delenv("ASTRAI_BACKEND", raising=False)
    with (
        attn_backend(name),
        pytest.raises(BackendUnavailable, match=f"{name}.*forced by attn_backend.*torch"),
    ):
        select_backend(CPU, torch.float32)


def test_context_manager_beats_env_nests_and_restores(monkeypatch):
    monkeypatch.setenv("ASTRAI_BACKEND", "cuda")
    with attn_backend("torch"):
        assert select_backend(CPU, torch.float32).name == "torch"
        with attn_backend("flash"):
            with pytest.raises(BackendUnavailable):
                select_backend(CPU, torch.float32)
        assert select_backend(CPU, torch.float32).name == "torch"  # the inner block restored "torch"
    with pytest.raises(BackendUnavailable):  # and the outer one restored the environment's choice
        select_backend(CPU, torch.float32)
    with pytest.raises(ValueError, match="not an attention backend"):
        attn_backend("nope").__enter__()


def test_selection_is_per_thread(monkeypatch):
    monkeypatch.delenv("ASTRAI_BACKEND", raising=False)
    barrier, seen = threading.Barrier(2), {}

    def worker(name):
        with attn_backend(name):
            barrier.wait()  # both threads are inside their blocks at once
            try:
                seen[name] = select_backend(CPU, torch.float32).name
            except BackendUnavailable:
                seen[name] = "refused"
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("torch", "cuda")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"torch": "torch", "cuda": "refused"}
    assert select_backend(CPU, torch.float32).name == "torch"  # nothing leaked into this thread


def test_engine_runs_under_a_forced_backend_and_refuses_an_unavailable_one(model, make_engine, monkeypatch):
    from astrai_pl.inference import SamplingParams

    monkeypatch.delenv("ASTRAI_BACKEND", raising=False)
    engine = make_engine(model, page_size=4)
    params = SamplingParams(max_tokens=3, temperature=0)
    with attn_backend("torch"):
        assert len(engine.generate([[5, 6, 7]], params)[0].token_ids) == 3
    with attn_backend("flash"), pytest.raises(BackendUnavailable):
        engine.generate([[5, 6, 7]], params)
