"""The training objectives: one LightningModule each over the shared Transformer."""

from .base import Objective
from .pretrain import Pretrain

__all__ = ["Objective", "Pretrain"]
