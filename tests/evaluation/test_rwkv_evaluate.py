"""`astrai-pl evaluate` on an RWKV checkpoint: lm-eval's requests scored through the recurrent engine."""

from __future__ import annotations

import io
import json

import pytest
import torch

from astrai_pl.evaluation import AstraiLM
from astrai_pl.evaluation.run import evaluate_verb
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def rwkv_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("rwkv-hf")
    Transformer(ModelConfig.from_name("rwkv-debug")).save_pretrained(path, tokenizer=Tokenizer.byte_level())
    return path


def test_scores_equal_the_models_own_log_probabilities(rwkv_dir):
    lm = AstraiLM.from_pretrained(str(rwkv_dir), max_total_tokens=4096)
    model = Transformer.from_pretrained(rwkv_dir).eval()
    windows = [(list(range(5, 30)), 9), (list(range(5, 18)), 9), ([7, 3, 9, 11, 40, 41], 2)]
    scores = lm.score_windows(windows)
    for (ids, start), (total, _) in zip(windows, scores):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits.double(), -1)[0]
        expected = sum(logp[i - 1, ids[i]].item() for i in range(start, len(ids)))
        assert total == pytest.approx(expected, abs=1e-4)


def test_the_verb_runs_a_task_on_an_rwkv_checkpoint(rwkv_dir, tmp_path):
    out = tmp_path / "results.json"
    evaluate_verb(["--model", str(rwkv_dir), "--tasks", "astrai_next_sentence", "--limit", "3",
                   "--max-total-tokens", "4096", "--output", str(out)], stdout=io.StringIO())
    results = json.loads(out.read_text())["results"]["astrai_next_sentence"]
    assert 0 <= results["acc,none"] <= 1
