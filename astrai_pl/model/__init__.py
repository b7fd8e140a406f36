"""The shared decoder transformer (plain nn.Module, no Lightning)."""

from .config import PRESETS, ConfigError, ModelConfig
from .transformer import Transformer, TransformerOutput

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "Transformer", "TransformerOutput"]
