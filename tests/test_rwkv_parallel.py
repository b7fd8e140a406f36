"""Tensor parallelism on RWKV models: the plan and its checks, and a run over two CPU processes (gloo) that
trains exactly as one process does (time mix and channel mix projections split, time_decay and time_first
sharded alike)."""

from __future__ import annotations

import pytest
import torch
from fit_runs import debug_config, final_weights, finish, launch, mean_losses, write_corpus

from astrai_pl.model import ModelConfig
from astrai_pl.parallel import _block_plan, check_tensor_parallel
from astrai_pl.strategy import ParallelConfigError

RWKV = {"model_type": "rwkv", "intermediate_size": 256}  # on configs/pretrain/debug.yaml's width and depth


def test_the_rwkv_plan_names_every_projection_but_the_channel_mix_gate():
    plan = _block_plan("rwkv")
    assert {name for name, style in plan.items() if type(style).__name__ == "ColwiseParallel"} == {
        "attention.key", "attention.value", "attention.receptance", "feed_forward.key"}
    assert {name for name, style in plan.items() if type(style).__name__ == "RowwiseParallel"} == {
        "attention.output", "feed_forward.value"}


def test_rwkv_tensor_parallel_checks_the_rwkv_widths_not_the_head_counts():
    cfg = ModelConfig.from_name("rwkv-debug", num_attention_heads=7, num_key_value_heads=7)  # unused by RWKV
    check_tensor_parallel(cfg, 2)
    with pytest.raises(ParallelConfigError, match=r"does not divide ModelConfig.hidden_size=64"):
        check_tensor_parallel(ModelConfig.from_name("rwkv-debug"), 3)
    with pytest.raises(ParallelConfigError, match=r"does not divide ModelConfig.intermediate_size=250"):
        check_tensor_parallel(ModelConfig.from_name("rwkv-debug", intermediate_size=250), 4)


@pytest.mark.slow
def test_rwkv_tensor_parallel_on_two_processes_trains_as_one(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    common = dict(max_steps=3, extra_callbacks=[{"class_path": "fit_runs.MeanLoss"}], arch=RWKV)
    tp_strategy = {"class_path": "astrai_pl.strategy.FSDP2Strategy", "init_args": {"tensor_parallel_size": 2}}
    configs = {"single": debug_config(tmp_path / "single", corpus, batch_size=8, **common),
               "tp": debug_config(tmp_path / "tp", corpus, batch_size=8, devices=2, strategy=tp_strategy,
                                  **common)}
    procs = {name: launch(config) for name, config in configs.items()}
    for proc in procs.values():
        finish(proc, timeout=400)
    single, tp = tmp_path / "single", tmp_path / "tp"
    assert len(mean_losses(single)) == 3
    torch.testing.assert_close(mean_losses(tp), mean_losses(single), rtol=1e-5, atol=1e-6)
    reference, weights = final_weights(single), final_weights(tp)
    assert weights.keys() == reference.keys()
    assert any(k.endswith("attention.time_decay") for k in reference)
    for key in reference:  # the sharded time_decay/time_first and the replicated μ, gathered whole
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-4, atol=1e-5)
