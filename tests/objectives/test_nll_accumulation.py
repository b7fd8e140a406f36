"""The chosen-token NLL terms of DPO (rpo_alpha, loss_type 'sft') and ORPO under gradient accumulation: two uneven
micro-batches (one pair, then three, with responses of different lengths) tagged as DPOData tags them give the
gradient of one batch of all four pairs — the NLL a mean over the window's chosen tokens, not a mean of the
micro-batches' means."""

from types import SimpleNamespace

import pytest
import torch
from test_global_counts import ARCH, batches

from astrai_pl.data.windows import chosen_tokens_in, pairs_in
from astrai_pl.objectives import DPO, ORPO

OBJECTIVES = {
    "dpo_rpo_alpha": lambda: DPO(arch=ARCH, rpo_alpha=0.5),
    "dpo_sigmoid_and_sft": lambda: DPO(arch=ARCH, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.7]),
    "orpo": lambda: ORPO(arch=ARCH),
}
MICRO = (slice(0, 1), slice(1, 4))  # uneven: 1 pair, then 3


def gradient(name: str, micro_batches: list[dict[str, torch.Tensor]], k: int) -> torch.Tensor:
    """The flat gradient summed over `micro_batches`, each loss divided by k as Lightning does."""
    torch.manual_seed(0)
    module = OBJECTIVES[name]().train()
    module._trainer = SimpleNamespace(accumulate_grad_batches=k, strategy=None)
    with torch.no_grad():  # policy != reference: DPO's loss is not at its flat point
        module.model.lm_head.weight.add_(0.05 * torch.randn_like(module.model.lm_head.weight))
    for batch in micro_batches:
        loss, _ = module._shared_step(batch, "train")
        (loss / k).backward()
    return torch.cat([p.grad.flatten() for p in module.model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", OBJECTIVES)
def test_two_uneven_micro_batches_give_the_gradient_of_one_batch(name):
    whole = batches()["pairs"]
    parts = [{k: v[rows] for k, v in whole.items()} for rows in MICRO]
    window = {"window_pairs": pairs_in(whole), "window_chosen_tokens": chosen_tokens_in(whole)}
    one_batch = gradient(name, [whole], k=1)
    accumulated = gradient(name, [{**part, **window} for part in parts], k=2)
    torch.testing.assert_close(accumulated, one_batch, rtol=1e-4, atol=1e-6)
    # Counted per pair only, the NLL would be a mean of the two micro-batches' token means: another gradient.
    pairs_only = gradient(name, [{**part, "window_pairs": window["window_pairs"]} for part in parts], k=2)
    assert not torch.allclose(pairs_only, one_batch, rtol=1e-2, atol=1e-5)
