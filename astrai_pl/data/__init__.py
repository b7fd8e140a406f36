"""LightningDataModules and the pure functions behind them."""

from .pretrain import PretrainData

__all__ = ["PretrainData"]
