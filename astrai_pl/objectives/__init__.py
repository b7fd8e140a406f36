"""The training objectives: one LightningModule each over the shared Transformer."""

from .base import Objective
from .dpo import DPO
from .evaluation import greedy_accuracy
from .grpo import GRPO
from .pretrain import Pretrain
from .sft import SFT

__all__ = ["Objective", "Pretrain", "SFT", "DPO", "GRPO", "greedy_accuracy"]
