"""The cuda backend's calls (decode kernel + prefill path) with windows, soft-caps and a model's own scale.

On CPU its ops run their references and the sdpa/flex prefill implementations, so this checks how the
backend splits a mixed step and passes each layer's window / soft-cap / scale, against the torch backend.
"""

from __future__ import annotations

import pytest
import torch

from astrai_pl.inference.attention import StepView
from astrai_pl.inference.attention.cuda_backend import CudaBackend
from astrai_pl.inference.attention.torch_backend import TorchBackend
from astrai_pl.inference.cache import KVStorage, ReqToTokenPool
from astrai_pl.inference.pool import KVPool
from astrai_pl.ops.prefill import override_prefill


def mixed_step(backend, page_size: int = 4):
    """Two decodes after 9 and 21 cached tokens, a chunk of 6 after 5, and a whole 11-token prompt."""
    g = torch.Generator().manual_seed(0)
    storage = KVStorage(1, 64 * page_size, 2, 16, torch.float32, torch.device("cpu"))
    pool = KVPool(storage, ReqToTokenPool(4, 64, torch.device("cpu")), page_size, prefix_cache=False)
    prefix, extend = [9, 21, 5, 0], [1, 1, 6, 11]
    out_slots = []
    for row, (p, n) in enumerate(zip(prefix, extend)):
        slots = pool.slots(pool.allocate(pool.pages_for(p + n)), 0, p + n)
        pool.req_to_token.write([row] * len(slots), list(range(p + n)), slots)
        out_slots += slots[p:]
    storage.k.copy_(torch.randn(storage.k.shape, generator=g))
    storage.v.copy_(torch.randn(storage.v.shape, generator=g))
    view = StepView.build(storage, pool.req_to_token.table, backend, [0, 1, 2, 3], prefix, extend, out_slots,
                          page_size)  # fmt: skip
    q = torch.randn(sum(extend), 4, 16, generator=g)
    return view, q


@pytest.mark.parametrize("prefill", ["sdpa", "flex"])
@pytest.mark.parametrize("shape", [{}, {"window": 4}, {"softcap": 3.0}, {"scale": 0.5, "window": 7, "softcap": 9.0}])
def test_cuda_backend_equals_torch_backend(prefill, shape):
    results = []
    for backend in (TorchBackend(), CudaBackend()):
        view, q = mixed_step(backend)
        with override_prefill(prefill):
            view.meta = backend.prepare(view, q.shape[1])
        k_new = view.storage.k[0][view.out_slots]
        results.append(backend.attend(view, 0, q, k_new, view.storage.v[0][view.out_slots], **shape))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
