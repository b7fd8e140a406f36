"""The shared decoder transformer (plain nn.Module, no Lightning)."""

from .config import PRESETS, ConfigError, ModelConfig
from .lora import LoraConfig, adapters_disabled, merge_lora
from .transformer import Transformer, TransformerOutput

__all__ = ["PRESETS", "ConfigError", "LoraConfig", "ModelConfig", "Transformer", "TransformerOutput", "adapters_disabled",
           "merge_lora"]
