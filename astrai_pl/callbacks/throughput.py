"""Tokens per second and model FLOPs utilisation (MFU), counted from the batches actually trained.

FLOPs of one training step (forward + backward = 3 × forward), from the model config:

    dense     = 6 · P_active · N_real              P_active: weights each token multiplies through
                                                   (attention and MLP projections of the experts it is
                                                   routed to, router, lm_head; embeddings are a lookup)
    attention = 12 · layers · heads · head_dim · A  A: (query, key) pairs attended: Σ L(L+1)/2 over the
                                                   documents of each row (causal, block-causal when packed)

N_real counts non-padding tokens, so packed and variable-length batches are measured by what they hold.
This follows PaLM's appendix B, except that A counts causal pairs rather than T² per row: a causal
kernel skips the masked half. MFU = achieved model FLOP/s per device ÷ the device's peak.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import lightning as L
import torch

from ..data.packing import IGNORE_INDEX
from ..model import ModelConfig
from ..model.flops import training_flops

# Dense (no sparsity) peak FLOP/s per device from vendor datasheets: bf16/fp16 tensor cores, and fp32.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250e12, "fp32": 80e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},  # SXM
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp32": 31.2e12},
    "V100": {"bf16": 125e12, "fp32": 15.7e12},  # fp16 tensor cores (no bf16)
    "T4": {"bf16": 65e12, "fp32": 8.1e12},
    "MI300X": {"bf16": 1307e12, "fp32": 163.4e12},
}


# -- FLOPs from the config ------------------------------------------------------------------------------
def real_token_mask(batch: dict[str, torch.Tensor], pad_id: int | None) -> torch.Tensor:
    """(B, T) True where a token is data: `attention_mask` if given, else all but the trailing padding
    (pad_id with an ignored label) that collate functions append."""
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    ids = batch["input_ids"]
    if pad_id is None or "labels" not in batch:
        return torch.ones_like(ids, dtype=torch.bool)
    is_pad = (ids == pad_id) & (batch["labels"] == IGNORE_INDEX)
    trailing = is_pad.flip(1).int().cumprod(1).flip(1).bool()
    return ~trailing


def attended_pairs(batch: dict[str, torch.Tensor], real: torch.Tensor) -> torch.Tensor:
    """Σ over rows and documents of L(L+1)/2: each real token attends to itself and the earlier tokens of
    its document (from document_ids, or from position_ids restarting at 0). Computed on the batch's device."""
    docs = batch.get("document_ids")
    if docs is None and "position_ids" in batch:
        docs = (batch["position_ids"] == 0).long().cumsum(1)
    index = torch.arange(real.size(1), device=real.device).expand_as(real)
    if docs is None:
        position = index  # one causal document per row
    else:
        starts = torch.ones_like(real)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        position = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    return ((position + 1) * real).sum()


def batch_counts(cfg: ModelConfig, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(real tokens, trained tokens, training FLOPs) of one batch, as a float64 tensor on its device."""
    real = real_token_mask(batch, cfg.pad_token_id)
    tokens = real.sum()
    trained = (batch["labels"][:, 1:] != IGNORE_INDEX).sum() if "labels" in batch else tokens
    flops = training_flops(cfg, tokens.double(), attended_pairs(batch, real).double())
    return torch.stack([tokens.double(), trained.double(), flops])


# -- peak FLOP/s ----------------------------------------------------------------------------------------
def precision_family(precision: str) -> str:
    return "bf16" if "16" in str(precision) else "fp32"


def table_peak_flops(device_name: str, precision: str) -> float | None:
    """The datasheet peak for a device name such as 'NVIDIA H100 80GB HBM3', or None if not listed."""
    for key, peaks in PEAK_FLOPS.items():  # ordered: specific names before their prefixes
        if key.lower() in device_name.lower():
            return peaks[precision_family(precision)]
    return None


def measured_peak_flops(
    device: torch.device, dtype: torch.dtype, seconds: float = 0.3, n: int = 1024
) -> float:
    """FLOP/s of square matmuls in `dtype` on `device`: the CPU's peak as this process can reach it."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * count / (time.perf_counter() - start)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB: process peak RSS


class Throughput(L.Callback):
    """Logs `throughput/tokens_per_sec` (all ranks; also in the progress bar), `trained_tokens_per_sec`,
    `mfu`, `tflops_per_device`, `step_time` and `peak_memory_gb` after every optimizer step.

    Args:
        peak_flops: Peak FLOP/s of one device. None: the datasheet table for GPUs (keyed by the device
            name and the trainer's precision), a short matmul measurement on CPU or unlisted devices.
        window: Optimizer steps averaged into each logged rate.
    """

    def __init__(self, peak_flops: float | None = None, window: int = 10):
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"Throughput.peak_flops={peak_flops}: must be positive FLOP/s, e.g. 312e12")
        self.peak_flops, self.window = peak_flops, window
        self._history: list[tuple[float, float, float, float]] = []  # (time, real, trained, flops) per step
        self._counts: torch.Tensor | None = None  # since the last optimizer step, on the device
        self._step_seen, self._paused, self._pause_start = -1, 0.0, None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.config: ModelConfig = pl_module.model.config
        device = trainer.strategy.root_device
        precision = str(trainer.precision)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.peak = self.peak_flops or table_peak_flops(name, precision)
        if self.peak is None:
            dtype = torch.bfloat16 if precision_family(precision) == "bf16" else torch.float32
            self.peak = measured_peak_flops(device, dtype)
        mesh = getattr(pl_module, "_device_mesh", None)
        self.tensor_parallel = mesh["tensor_parallel"].size() if mesh is not None else 1

    def _clock(self) -> float:
        return time.perf_counter() - self._paused  # training time: validation runs are left out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._paused, self._pause_start = 0.0, None
        self._history = [(self._clock(), 0.0, 0.0, 0.0)]
        self._step_seen = trainer.global_step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: dict[str, torch.Tensor],
        batch_idx: int,
    ) -> None:
        counts = batch_counts(self.config, batch)  # no host sync until the step is complete
        self._counts = counts if self._counts is None else self._counts + counts
        if trainer.global_step == self._step_seen:
            return  # accumulating: the step is not finished
        self._step_seen = trainer.global_step
        self._log_step(trainer, pl_module)

    def _log_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        totals = trainer.strategy.reduce(self._counts, reduce_op="sum").cpu()  # every rank's tokens and FLOPs
        self._counts = None
        tp = self.tensor_parallel  # tensor-parallel peers train the same tokens
        tokens, trained, flops = (totals / tp).tolist()
        last = self._history[-1]
        self._history.append((self._clock(), last[1] + tokens, last[2] + trained, last[3] + flops))
        self._history = self._history[-(self.window + 1) :]
        (t0, n0, m0, f0), (t1, n1, m1, f1) = self._history[0], self._history[-1]
        seconds, world = max(t1 - t0, 1e-9), trainer.world_size
        per_device = (f1 - f0) / seconds / world  # each device runs 1/world of the step's FLOPs
        pl_module.log(
            "throughput/tokens_per_sec", (n1 - n0) / seconds, prog_bar=True, on_step=True, on_epoch=False
        )
        pl_module.log_dict(
            {
                "throughput/trained_tokens_per_sec": (m1 - m0) / seconds,
                "throughput/tflops_per_device": per_device / 1e12,
                "throughput/mfu": per_device / self.peak,
                "throughput/step_time": seconds / (len(self._history) - 1),
                "throughput/peak_memory_gb": peak_memory_gb(device),
            },
            on_step=True,
            on_epoch=False,
        )
