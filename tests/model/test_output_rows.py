"""`Transformer.hidden_states(output_rows=...)`: the states at a few rows, the last layer computing only them,
equal the full forward's rows for every family, with packed documents, prefix-tree branches and windows, and
take the same gradients."""

import pytest
import torch

from astrai_pl.model import ModelConfig, Transformer

FAMILIES = [("debug", {}), ("debug", dict(sliding_window=5)), ("debug", dict(num_experts=4)),
            ("gemma2-debug", {}), ("gemma3-debug", {}), ("phi3-debug", {}), ("olmo2-debug", {}),
            ("rwkv-debug", {})]


def picked(hidden, rows):
    return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))


@pytest.mark.parametrize(("preset", "overrides"), FAMILIES, ids=[f"{p}{o}" for p, o in FAMILIES])
def test_the_wanted_rows_equal_the_full_forwards(preset, overrides):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(preset, **overrides)).eval()
    ids = torch.randint(4, 200, (3, 17))
    rows = torch.tensor([[16, 3], [0, 9], [12, 12]])
    with torch.no_grad():
        full, _ = model.hidden_states(ids)
        few, _ = model.hidden_states(ids, output_rows=rows)
    assert few.shape == (3, 2, full.shape[-1])
    torch.testing.assert_close(few, picked(full, rows), rtol=1e-4, atol=1e-5)


def test_packed_documents_and_tree_branches_keep_their_masks_for_the_wanted_rows():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug", sliding_window=4)).eval()
    ids = torch.randint(4, 200, (2, 12))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])  # row 0: two documents
    branches = torch.tensor([[0] * 12, [0] * 4 + [1] * 4 + [2] * 4])
    positions_tree = torch.tensor([list(range(12)), list(range(8)) + list(range(4, 8))])
    rows = torch.tensor([[4, 11], [7, 11]])
    with torch.no_grad():
        for kw in (dict(position_ids=positions), dict(position_ids=positions_tree, branch_ids=branches)):
            full, _ = model.hidden_states(ids, **kw)
            few, _ = model.hidden_states(ids, output_rows=rows, **kw)
            torch.testing.assert_close(few, picked(full, rows), rtol=1e-4, atol=1e-5)


def test_the_wanted_rows_take_the_full_forwards_gradients():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug"))
    ids, rows = torch.randint(4, 200, (2, 10)), torch.tensor([[9], [4]])
    grads = []
    for few in (False, True):
        model.zero_grad()
        hidden = model.hidden_states(ids, output_rows=rows)[0] if few else picked(model.hidden_states(ids)[0], rows)
        hidden.square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, full in grads[0].items():  # float32 rounding of other matmul shapes, relative to each gradient
        scale = float(full.abs().max())
        torch.testing.assert_close(grads[1][name], full, rtol=1e-4, atol=1e-4 * scale, msg=name)
