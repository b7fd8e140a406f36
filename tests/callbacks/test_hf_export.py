import json

import torch
from fit_runs import quiet_trainer

from astrai_pl.callbacks import HFExport
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives import Pretrain
from astrai_pl.tokenizer import Tokenizer


def _batches(n=8):
    torch.manual_seed(1)
    return torch.utils.data.DataLoader(
        [{"input_ids": x, "labels": x} for x in torch.randint(3, 320, (n, 2, 16))], batch_size=None
    )


def test_exports_at_intervals_and_at_the_end(tmp_path):
    torch.manual_seed(0)
    module = Pretrain(arch=ModelConfig.from_name("debug"), tokenizer=Tokenizer.byte_level())
    export = HFExport(dirpath=str(tmp_path / "hf"), every_n_train_steps=2, keep_last=1)
    trainer = quiet_trainer(max_steps=4, accumulate_grad_batches=2, callbacks=[export])
    trainer.fit(module, train_dataloaders=_batches())
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["final", "step-00000004"]  # step-2 pruned
    final = tmp_path / "hf" / "final"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (final / name).is_file(), name
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [2, 4]  # eos, <|im_end|>
    loaded = Transformer.from_pretrained(final)
    for key, value in module.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_interval_exports_happen_on_optimizer_steps_only(tmp_path):
    module = Pretrain(arch=ModelConfig.from_name("debug"))
    export = HFExport(dirpath=str(tmp_path / "hf"), every_n_train_steps=1, at_end=False)
    trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=3, callbacks=[export])
    trainer.fit(module, train_dataloaders=_batches())
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step-00000001", "step-00000002"]
