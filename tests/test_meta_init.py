"""Models built on the meta device and filled shard by shard (astrai_pl/deferred_init.py): two gloo processes each
grow by about half of what one process holding the whole model grows by; the drawn weights do not depend on how
many processes hold them; a Hugging Face checkpoint read into the shards gives the unsharded model's logits; what
a meta-device build does not cover is refused by name."""

from __future__ import annotations

import copy
import json
import sys

import lightning as L
import pytest
import torch
from fit_runs import ROOT, _env, _start, finish, free_port, quiet_trainer
from meta_runs import BIG, IDS

from astrai_pl.checkpoint import CheckpointError
from astrai_pl.cli import lightning_main
from astrai_pl.deferred_init import materialize
from astrai_pl.model import ConfigError, LoraConfig, ModelConfig, Transformer
from astrai_pl.objectives import DPO, Pretrain
from astrai_pl.strategy import FSDP2Strategy

HF_ARCH = dict(vocab_size=321, tie_word_embeddings=True, num_hidden_layers=3)  # 321 rows: uneven shards


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process building BIG whole in host memory, beside two gloo ranks building it on the meta device."""
    out = tmp_path_factory.mktemp("meta")
    torch.manual_seed(0)
    Transformer(ModelConfig.from_name("debug", **HF_ARCH)).save_pretrained(out / "hf")
    script, port = str(ROOT / "tests" / "meta_runs.py"), str(free_port())
    procs = []
    for name, args, variables in [("whole", ["whole"], {}),
                                  *[(f"rank{r}", ["sharded"], dict(RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port,
                                                                   MASTER_ADDR="127.0.0.1")) for r in (0, 1)]]:
        (out / name).mkdir()
        cmd = [sys.executable, script, *args, str(out), str(out / "hf")]
        # one malloc arena: with glibc's several (one per thread that allocates), blocks freed in one arena are not
        # reused from another, and on a loaded machine a rank's peak grew by 60 MB more than the weights it holds
        procs.append((_start(out / name, cmd, _env(1, MALLOC_ARENA_MAX="1", **variables)), out / name))
    for proc, folder in procs:
        finish(proc, folder=folder)
    return out


def test_each_of_two_processes_grows_by_about_half_of_a_whole_model(runs):
    whole = json.loads((runs / "rss-whole-0.json").read_text())
    ranks = [json.loads((runs / f"rss-sharded-{r}.json").read_text()) for r in (0, 1)]
    weights_kb = whole["held"] * 4 / 1024
    assert whole["growth_kb"] >= 0.95 * weights_kb  # the measure sees the weights: 268 MB of them
    for rank in ranks:
        assert rank["held"] == pytest.approx(whole["held"] / 2, rel=0.01)
        # half the weights, plus at most one module drawn whole (4 MB) and the layout's own bookkeeping
        assert rank["growth_kb"] <= 0.6 * whole["growth_kb"], (rank, whole)


def test_drawn_weights_do_not_depend_on_how_many_processes_hold_them(runs):
    sharded = torch.load(runs / "sharded.pt", weights_only=True)["weights"]
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_name("debug"))
    materialize(model, copy.deepcopy(model), torch.device("cpu"), None, seed=0)
    assert sharded.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        assert torch.equal(sharded[name], param.detach()), name
    std = ModelConfig.from_name("debug").initializer_range
    assert model.layers[0].mlp.gate_proj.weight.std().item() == pytest.approx(std, rel=0.05)  # the rules of a whole
    assert model.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(std / 2, rel=0.05)  # 1/sqrt(2·2)
    assert torch.equal(model.norm.weight, torch.ones(64))


def test_a_hugging_face_checkpoint_read_into_shards_gives_the_unsharded_logits(runs):
    logits = torch.load(runs / "sharded.pt", weights_only=True)["logits"]
    reference = Transformer.from_pretrained(runs / "hf")
    with torch.no_grad():
        assert torch.equal(logits, reference(IDS).logits)


def test_a_one_process_meta_build_reads_hugging_face_weights_and_draws_from_its_seed(tmp_path):
    torch.manual_seed(0)
    source = Transformer(ModelConfig.from_name("debug", **HF_ARCH))
    source.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_name("debug", **HF_ARCH))
    materialize(model, copy.deepcopy(model), torch.device("cpu"), tmp_path / "hf", seed=0)
    for name, tensor in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    twice = []
    for _ in range(2):
        with torch.device("meta"):
            fresh = Transformer(ModelConfig.from_name("debug"))
        materialize(fresh, copy.deepcopy(fresh), torch.device("cpu"), None, seed=7)
        twice.append(fresh.state_dict())
    assert all(torch.equal(twice[0][k], twice[1][k]) for k in twice[0])
    assert all(torch.isfinite(v).all() for v in twice[0].values())


def test_what_a_meta_device_build_does_not_cover_is_refused_by_name(tmp_path):
    debug = ModelConfig.from_name("debug")
    torch.save({"state_dict": {}}, tmp_path / "last.ckpt")
    with torch.device("meta"):
        with pytest.raises(ConfigError, match=r"meta-device build with lora: .* set meta_init: false"):
            Pretrain(arch=debug, lora=LoraConfig(r=4))
        with pytest.raises(ConfigError, match=r"meta-device build of an RWKV model"):
            Pretrain(arch=ModelConfig.from_name("debug", model_type="rwkv"))
        with pytest.raises(ConfigError, match=r"frozen reference copy of a model built on the meta device"):
            DPO(arch=debug)
        with pytest.raises(CheckpointError, match=r"this is an astrai-pl checkpoint\. Fix: export it first"):
            Pretrain(init_from=str(tmp_path / "last.ckpt"))
    assert next(Pretrain(arch=debug).model.parameters()).device.type == "cpu"  # outside it: as before


def test_bigger_model_shape_is_what_the_bound_assumes():
    """BIG's weights dominate: 268 MB, no module over 1/60 of them (the one drawn whole at a time)."""
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_name("debug", **BIG))
    sizes = [p.numel() for p in model.parameters()]
    assert sum(sizes) * 4 > 250 * 2**20 and max(sizes) * 60 < sum(sizes)


# -- through Lightning: the option in a config, one FSDP2 rank in this process ------------------------------------
@pytest.fixture
def one_rank_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _first_losses(module, strategy) -> list[float]:
    ids = torch.randint(3, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    batches = torch.utils.data.DataLoader([{"input_ids": ids, "labels": ids}] * 2, batch_size=None)
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(outputs["loss"]))

    quiet_trainer(devices=1, strategy=strategy, max_steps=2, callbacks=[Record()]).fit(module, train_dataloaders=batches)
    return seen


def test_meta_init_from_a_config_trains_as_the_model_built_whole_from_the_same_checkpoint(tmp_path, one_rank_group):
    torch.manual_seed(0)
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path / "hf")
    cli = lightning_main(["--config", str(ROOT / "configs/pretrain/debug.yaml"), "--trainer.accelerator", "cpu",
                          "--trainer.logger", "false", "--model.init_args.init_from", str(tmp_path / "hf"),
                          "--model.init_args.meta_init", "true"], run=False)
    assert all(p.is_meta for p in cli.model.model.parameters())
    whole = _first_losses(Pretrain(init_from=str(tmp_path / "hf")), "auto")
    one_device = _first_losses(Pretrain(init_from=str(tmp_path / "hf"), meta_init=True), "auto")
    sharded = _first_losses(Pretrain(init_from=str(tmp_path / "hf"), meta_init=True), FSDP2Strategy())
    assert one_device == whole
    assert sharded == pytest.approx(whole, rel=1e-5)
