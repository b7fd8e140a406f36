"""An exported Hugging Face directory (our Transformer + the byte tokenizer, which transformers loads) shared by
the evaluation tests, and AstraiLM over it."""

from __future__ import annotations

import pytest
import torch

from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A debug model with a wide initialisation, so that its greedy tokens are clear winners (no near ties
    that float rounding could flip), saved with the byte tokenizer and its chat template."""
    torch.manual_seed(0)
    config = ModelConfig.from_name("debug", initializer_range=0.3)
    path = tmp_path_factory.mktemp("hf")
    Transformer(config).save_pretrained(path, tokenizer=Tokenizer.byte_level())
    return path


@pytest.fixture(scope="session")
def ours(hf_dir):
    from astrai_pl.evaluation import AstraiLM

    return AstraiLM.from_pretrained(str(hf_dir), max_total_tokens=8192)
