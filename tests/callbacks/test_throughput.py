import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.callbacks import Throughput
from astrai_pl.callbacks.throughput import attended_pairs, real_token_mask, table_peak_flops
from astrai_pl.model import ModelConfig
from astrai_pl.model.flops import active_matmul_params, training_flops
from astrai_pl.objectives import Pretrain


def test_flops_of_the_debug_model_by_hand():
    cfg = ModelConfig.from_name("debug")  # hidden 64, 4 heads of 16, 2 kv heads, MLP 160, 2 layers, vocab 320
    per_layer = 64 * 16 * (4 + 2 * 2) + 4 * 16 * 64 + 3 * 64 * 160
    assert active_matmul_params(cfg) == 2 * per_layer + 64 * 320
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long)}
    real = real_token_mask(batch, pad_id=0)
    assert int(attended_pairs(batch, real)) == 2 * (8 * 9 // 2)  # causal: position t sees t + 1 keys
    assert training_flops(cfg, 16, 72) == 6 * active_matmul_params(cfg) * 16 + 12 * 2 * 4 * 16 * 72


def test_packed_and_padded_batches_count_only_real_tokens_and_their_own_documents():
    pad = 0
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9, pad, pad], [5, 6, 7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[-100, 6, 7, -100, 9, -100, -100], [-100, 6, 7, 8, 9, 10, 11]]),
        "document_ids": torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0]]),
    }
    real = real_token_mask(batch, pad)
    assert real.sum() == 12  # the two trailing pads are not data
    assert int(attended_pairs(batch, real)) == (6 + 3) + 28  # documents of 3 and 2 tokens; one row of 7


def test_restarting_position_ids_mark_documents_too():
    batch = {
        "input_ids": torch.ones(1, 6, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
    }
    assert int(attended_pairs(batch, real_token_mask(batch, None))) == 6 + 6


def test_moe_counts_only_the_routed_experts():
    dense = ModelConfig.from_name("debug")
    moe = ModelConfig.from_name("debug", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=160)
    mlp = 3 * 64 * 160
    assert active_matmul_params(moe) - active_matmul_params(dense) == 2 * (8 * 64 + 2 * mlp - mlp)


def test_peak_table_matches_device_names():
    assert table_peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989e12
    assert table_peak_flops("NVIDIA H100 PCIe", "bf16-mixed") == 756e12
    assert table_peak_flops("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12
    assert table_peak_flops("cpu", "32-true") is None


def test_logs_tokens_per_second_mfu_and_shows_them_in_the_progress_bar(tmp_path):
    torch.manual_seed(1)
    ids = torch.randint(3, 320, (6, 2, 16))
    data = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=None)
    trainer = quiet_trainer(
        max_steps=3,
        accumulate_grad_batches=2,
        callbacks=[Throughput(peak_flops=1e12)],
        default_root_dir=tmp_path,
    )
    trainer.fit(Pretrain(arch=ModelConfig.from_name("debug")), train_dataloaders=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert "throughput/tokens_per_sec" in trainer.progress_bar_metrics
    assert metrics["throughput/trained_tokens_per_sec"] == pytest.approx(
        metrics["throughput/tokens_per_sec"] * 15 / 16, rel=1e-4
    )  # the last token of a row has no target
    assert 0 < metrics["throughput/mfu"] < 1
    assert metrics["throughput/mfu"] == pytest.approx(metrics["throughput/tflops_per_device"], rel=1e-4)
    assert metrics["throughput/peak_memory_gb"] > 0
