"""The reward model's per-pair `margin` (TRL's): a column of the preference rows, carried through encoding and
batching, subtracted from the score gap in the loss; a bad value is refused naming its line."""

import json

import pytest
import torch

from astrai_pl.data import DataError, DPOData
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import RewardModel
from astrai_pl.objectives.preference_losses import bradley_terry_loss

ARCH = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def pair_file(tmp_path, margins):
    rows = [{"prompt": f"Pick {i}.", "chosen": " yes", "rejected": " no" * (1 + i % 3), "margin": m}
            for i, m in enumerate(margins)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_each_pair_carries_its_margin_into_the_batch_and_the_loss(tmp_path):
    margins = [0.25 * i for i in range(8)]
    data = DPOData(path=pair_file(tmp_path, margins), val_split=None, val_fraction=0.25, batch_size=8,
                   cache_dir=str(tmp_path / "cache"))
    data.setup()
    batches = [next(iter(data._loader(split))) for split in (data.train_set, data.val_set)]
    seen = sorted(float(m) for b in batches for m in b["margin"])
    assert seen == margins
    prompt = data.tokenizer.decode(batches[0]["chosen_input_ids"][0].tolist())
    number = int(prompt.split("Pick ")[1].split(".")[0])
    assert float(batches[0]["margin"][0]) == margins[number]  # the row's own margin, not another's

    torch.manual_seed(0)
    model = RewardModel(arch=ARCH).eval()
    batch = batches[0]
    with torch.no_grad():
        chosen, rejected = model.scores(batch)
        loss, _ = model._shared_step(batch, "val")
        plain, _ = model._shared_step({k: v for k, v in batch.items() if k != "margin"}, "val")
    expected, _ = bradley_terry_loss(chosen, rejected, batch["margin"])
    torch.testing.assert_close(loss, expected)
    assert float(loss) > float(plain)  # a required gap > 0 raises the loss of the same scores


@pytest.mark.parametrize("bad", ["big", None, True, float("inf")])
def test_a_margin_that_is_not_a_finite_number_names_its_line(tmp_path, bad):
    margins = [0.5, 0.5, bad, 0.5, 0.5]
    data = DPOData(path=pair_file(tmp_path, margins), val_split=None, val_fraction=0.2, batch_size=2,
                   cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"(?s)line 3.*margin"):
        data.setup()
