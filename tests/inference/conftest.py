"""Shared fixtures: a seeded debug model whose greedy output depends on its context, and references."""

import pytest
import torch

from astrai_pl.inference import Engine
from astrai_pl.model import ModelConfig, Transformer


def _wide_debug_model(seed: int = 0, config: ModelConfig | None = None) -> Transformer:
    """The debug preset (or `config`) with wide weights, so greedy decoding neither repeats one token nor ignores
    context.

    Logits stay within a few units (lm_head at std 0.1), so float32 round-off stays far below 1e-5.
    """
    torch.manual_seed(seed)
    model = Transformer(config or ModelConfig.from_name("debug")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = {"embed_tokens.weight": 1.0, "lm_head.weight": 0.1}.get(name, 0.2)
                param.normal_(0.0, std)
    return model


@pytest.fixture(scope="session")
def model() -> Transformer:
    return _wide_debug_model(0)


@pytest.fixture(scope="session")
def other_model() -> Transformer:
    """Same shape as `model`, different weights."""
    return _wide_debug_model(1)


@pytest.fixture(scope="session")
def wide_model():
    """`wide_model(config, seed=0)`: a model of another shape with the wide weights of `model`."""
    return lambda config, seed=0: _wide_debug_model(seed, config)


@pytest.fixture(scope="session")
def make_engine():
    """Engine(model, debug=True, ...): the accounting is rechecked after every step (a 4k-token pool
    unless told otherwise, which keeps that recount quick)."""

    def make(model, **kwargs) -> Engine:
        kwargs.setdefault("max_total_tokens", 4096)
        return Engine(model, debug=True, **kwargs)

    return make


@pytest.fixture(scope="session")
def reference_greedy():
    """Greedy decoding by re-running the whole sequence without a cache at every step."""

    @torch.no_grad()
    def run(model, prompt: list[int], max_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    return run


@pytest.fixture(scope="session")
def random_prompts():
    def make(lengths, seed: int = 1, vocab: int = 320) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(8, vocab, (n,), generator=g).tolist() for n in lengths]

    return make
