import json

import torch
from fit_runs import quiet_trainer

from astrai_pl.callbacks import HFExport
from astrai_pl.checkpoint import load_transformer
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


LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}


def lora_fit(tmp_path, init_from):
    """A LoRA run of 2 steps from `init_from` with HFExport; the module and the final export's adapter config."""
    torch.manual_seed(0)
    module = Pretrain(init_from=str(init_from), lora=LORA, tokenizer=Tokenizer.byte_level())
    trainer = quiet_trainer(max_steps=2, callbacks=[HFExport(dirpath=str(tmp_path / "hf"))])
    trainer.fit(module, train_dataloaders=_batches())
    return module.model.eval(), json.loads((tmp_path / "hf" / "final" / "adapter_config.json").read_text())


def test_a_lora_runs_export_names_a_base_that_peft_loads_in_one_call(tmp_path, monkeypatch):
    from test_lora_base import peft_in_one_call, pretrain_run, same_logits

    ckpt = pretrain_run(tmp_path / "runs", 0, seed=3)  # a .ckpt, which PEFT cannot read: the base is written
    model, config = lora_fit(tmp_path, ckpt)
    assert config["base_model_name_or_path"] == str((tmp_path / "hf" / "base").resolve())
    base, want = Transformer.from_pretrained(tmp_path / "hf" / "base").state_dict(), load_transformer(None, str(ckpt))
    assert all(torch.equal(base[k], v) for k, v in want.state_dict().items())  # lm_head too, as before training
    assert not torch.equal(base["lm_head.weight"], model.lm_head.weight)  # the trained head is the adapter's
    monkeypatch.chdir(tmp_path / "runs")
    assert same_logits(peft_in_one_call(tmp_path / "hf" / "final", monkeypatch), model)


def test_a_lora_runs_export_names_its_hugging_face_init_from(tmp_path):
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path / "base", tokenizer=Tokenizer.byte_level())
    _, config = lora_fit(tmp_path, tmp_path / "base")
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert not (tmp_path / "hf" / "base").exists()  # no second copy of a base PEFT already reads


def test_a_lora_run_writes_its_base_once_for_all_its_exports(tmp_path, monkeypatch):
    from test_lora_base import pretrain_run

    from astrai_pl.model import lora

    ckpt = pretrain_run(tmp_path / "runs", 0, seed=3)  # a .ckpt: the base is written beside the exports
    writes, base_of = [], lora.base_of
    monkeypatch.setattr(lora, "base_of", lambda model: writes.append(1) or base_of(model))
    torch.manual_seed(0)
    module = Pretrain(init_from=str(ckpt), lora=LORA, tokenizer=Tokenizer.byte_level())
    export = HFExport(dirpath=str(tmp_path / "hf"), every_n_train_steps=1)
    quiet_trainer(max_steps=3, callbacks=[export]).fit(module, train_dataloaders=_batches())
    exports = sorted(p.name for p in (tmp_path / "hf").iterdir() if p.name != "base")
    assert len(exports) == 4 and len(writes) == 1  # three steps and the final one; the frozen base written once
    for name in exports:
        config = json.loads((tmp_path / "hf" / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str((tmp_path / "hf" / "base").resolve())
