"""LoRA on the objectives: the optimizer sees the adapter only, the run says how much trains, DPO's and GRPO's
reference is the base with the adapter off (no copy kept), and a LoRA checkpoint starts the next stage."""

import copy
import logging
import math

import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.checkpoint import load_transformer
from astrai_pl.data import Arithmetic, DPOData, GRPOData
from astrai_pl.model import LoraConfig, ModelConfig, Transformer
from astrai_pl.objectives import DPO, GRPO, SFT
from astrai_pl.objectives.dpo import pair_logps
from astrai_pl.objectives.logprobs import token_logprobs
from astrai_pl.tokenizer import Tokenizer

ARCH = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def adam(params):
    return torch.optim.AdamW(params, lr=1e-2)


def pairs(tmp_path):
    return DPOData(synthetic=Arithmetic(train_rows=48, test_rows=8), max_seq_len=64, batch_size=4,
                   cache_dir=str(tmp_path))


def lora_checkpoint(init_from, folder, data, steps=2) -> tuple[DPO, str]:
    """A DPO run with LoRA from `init_from` for `steps` steps, and the checkpoint it wrote."""
    module = DPO(init_from=str(init_from), optimizer=adam, lora=LORA, tokenizer=data.tokenizer)
    quiet_trainer(max_steps=steps, limit_val_batches=0, enable_checkpointing=True,
                  default_root_dir=str(folder)).fit(module, datamodule=data)
    return module, str(next(folder.rglob("*.ckpt")))


def batches(data, n=2):
    data.setup("fit")
    return [b for _, b in zip(range(n), data.train_dataloader())]


def test_the_optimizer_gets_the_adapter_only_and_the_run_says_how_much_trains(tmp_path, caplog):
    torch.manual_seed(0)
    data = pairs(tmp_path)
    dpo = DPO(arch=ARCH, optimizer=adam, lora=LORA, tokenizer=data.tokenizer)
    frozen = {n: p.detach().clone() for n, p in dpo.model.named_parameters() if not p.requires_grad}
    run = quiet_trainer(max_steps=3, limit_val_batches=0)
    with caplog.at_level(logging.INFO):
        run.fit(dpo, datamodule=data)
    optimized = {id(p) for group in run.optimizers[0].param_groups for p in group["params"]}
    adapter = {id(p) for n, p in dpo.model.named_parameters() if ".lora_" in n}
    assert optimized == adapter
    assert all(torch.equal(p, frozen[n]) for n, p in dpo.model.named_parameters() if n in frozen)
    trainable = sum(p.numel() for n, p in dpo.model.named_parameters() if ".lora_" in n)
    total = sum(p.numel() for p in dpo.model.parameters())
    assert f"trainable {trainable:,} of {total:,} parameters" in caplog.text


def test_dpo_with_lora_keeps_no_copy_and_its_reference_is_the_base(tmp_path):
    torch.manual_seed(0)
    data = pairs(tmp_path)
    dpo = DPO(arch=ARCH, optimizer=adam, lora=LORA, tokenizer=data.tokenizer)
    base = copy.deepcopy(dpo.model).eval()  # its adapters are fresh (B = 0): the base itself
    assert dpo.reference is None
    run = quiet_trainer(max_steps=4, limit_val_batches=0)
    run.fit(dpo, datamodule=data)
    batch = batches(data)[0]
    with torch.no_grad():
        expected = pair_logps(base, batch)
        got = dpo._reference_pair_logps(batch, "train")
        policy = pair_logps(dpo.model, batch)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(policy[0], expected[0])  # the adapter trained; the reference did not move


def test_dpo_with_lora_starts_at_log_2_as_with_a_frozen_copy(tmp_path):
    torch.manual_seed(0)
    data = pairs(tmp_path)
    dpo = DPO(arch=ARCH, optimizer=adam, lora=LORA, tokenizer=data.tokenizer)
    loss, _ = dpo._shared_step(batches(data)[0], "train")
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)


def test_grpo_with_lora_scores_its_kl_reference_on_the_base():
    torch.manual_seed(0)
    tokenizer = Tokenizer.byte_level()
    grpo = GRPO(arch=ModelConfig.from_name("debug"), tokenizer=tokenizer, max_completion_length=4, beta=0.1,
                lora=LORA)
    assert grpo.ref_model is None
    with torch.no_grad():
        for n, p in grpo.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # as after training: the policy is not the base
    base = copy.deepcopy(grpo.model)
    for _, m in base.named_modules():
        if hasattr(m, "enabled"):
            m.enabled = False
    data = GRPOData(synthetic=Arithmetic(train_rows=8, test_rows=2), batch_size=2)
    batch = batches(data, 1)[0]
    part = grpo.roll_out(batch, num_micro_batches=1).micro_batches[0]
    with torch.no_grad():
        expected = token_logprobs(base, part["input_ids"], part["labels"], temperature=grpo.hparams.temperature)
        policy = token_logprobs(grpo.model, part["input_ids"], part["labels"], temperature=grpo.hparams.temperature)
    scored = part["mask"].bool()
    torch.testing.assert_close(part["ref_logps"][scored], expected[scored])
    assert not torch.allclose(part["ref_logps"][scored], policy[scored])


def test_a_lora_checkpoint_from_init_from_holds_the_adapter_and_starts_the_next_stage(tmp_path):
    torch.manual_seed(0)
    Transformer(ARCH).save_pretrained(tmp_path / "base")
    data = pairs(tmp_path)
    dpo = DPO(init_from=str(tmp_path / "base"), optimizer=adam, lora=LORA, tokenizer=data.tokenizer)
    run = quiet_trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=True,
                        default_root_dir=str(tmp_path / "run"))
    run.fit(dpo, datamodule=data)
    ckpt = next((tmp_path / "run").rglob("*.ckpt"))
    stored = torch.load(ckpt, weights_only=True)
    assert stored["state_dict"] and all(".lora_" in k for k in stored["state_dict"])
    loaded = load_transformer(None, str(ckpt))  # the base from init_from, the adapter from the file
    batch = batches(data)[0]
    with torch.no_grad():
        for a, b in zip(pair_logps(loaded.eval(), batch), pair_logps(dpo.model.eval(), batch)):
            torch.testing.assert_close(a, b)
    nxt = SFT(init_from=str(ckpt), lora=LORA)  # the next stage: the previous adapter merged, a fresh one added
    assert nxt.model.lora_config is LORA
    with torch.no_grad():
        for a, b in zip(pair_logps(nxt.model.eval(), batch), pair_logps(loaded, batch)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_lora_checkpoint_whose_base_is_a_lora_checkpoint_loads_with_both_adapters(tmp_path):
    torch.manual_seed(0)
    Transformer(ARCH).save_pretrained(tmp_path / "base")
    data = pairs(tmp_path)
    _, first = lora_checkpoint(tmp_path / "base", tmp_path / "first", data)  # e.g. SFT with LoRA
    second, ckpt = lora_checkpoint(first, tmp_path / "second", data)  # then DPO with LoRA from its checkpoint
    loaded = load_transformer(None, ckpt).eval()
    batch = batches(data)[0]
    with torch.no_grad():
        for a, b in zip(pair_logps(loaded, batch), pair_logps(second.model.eval(), batch)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_full_fine_tune_from_a_lora_checkpoint_trains_every_weight(tmp_path):
    torch.manual_seed(0)
    Transformer(ARCH).save_pretrained(tmp_path / "base")
    data = pairs(tmp_path)
    _, ckpt = lora_checkpoint(tmp_path / "base", tmp_path / "lora", data, steps=1)
    full = DPO(init_from=ckpt, optimizer=adam, tokenizer=data.tokenizer)
    assert all(p.requires_grad for p in full.model.parameters())
    quiet_trainer(max_steps=1, limit_val_batches=0).fit(full, datamodule=data)  # a step that trains
