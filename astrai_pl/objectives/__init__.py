"""The training objectives: one LightningModule each over the shared Transformer."""

from .base import Objective
from .distill import Distill
from .dpo import DPO
from .evaluation import greedy_accuracy
from .grpo import GRPO
from .kto import KTO
from .online_dpo import OnlineDPO
from .orpo import ORPO
from .pretrain import Pretrain
from .reward import RewardModel
from .rloo import RLOO
from .sft import SFT
from .simpo import SimPO

__all__ = ["Objective", "Pretrain", "SFT", "DPO", "GRPO", "KTO", "ORPO", "SimPO", "RewardModel", "OnlineDPO", "RLOO",
           "Distill", "greedy_accuracy"]
