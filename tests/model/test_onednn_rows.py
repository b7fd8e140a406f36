"""A prefill chunk's projections reach oneDNN at a few bucketed row counts, so its per-shape state stays bounded
under continuous batching, and the padding never shows in the result."""

import pytest
import torch
import torch.nn.functional as F

from astrai_pl.model import layers
from astrai_pl.model.layers import Linear, onednn_rows


def test_buckets_pad_at_most_an_eighth_and_are_few():
    for rows in range(1, 5000):
        padded = onednn_rows(rows)
        assert rows <= padded <= max(rows + 15, rows * 9 // 8 + 1), rows
    assert len({onednn_rows(n) for n in range(65, 4097)}) == 44


@pytest.mark.skipif(not layers._ONEDNN, reason="this PyTorch build has no oneDNN linear")
@pytest.mark.parametrize("shape", [(65, 48), (3, 70, 48), (2, 128, 48)])
def test_the_padded_rows_are_dropped_and_the_rest_equal_f_linear(shape, monkeypatch):
    seen = []
    real = torch.ops.mkldnn._linear_pointwise

    def recorded(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recorded)
    torch.manual_seed(0)
    linear = Linear(48, 40, bias=True)
    x = torch.randn(*shape)
    with torch.no_grad():
        out = layers._as_stored(x, linear)
        expected = F.linear(x, linear.weight, linear.bias)
    rows = x.numel() // 48
    assert seen == [onednn_rows(rows)]
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
