"""LightningDataModules and the pure functions behind them."""

from .base import RowsData
from .dpo import DPOData, collate_pairs
from .formats import ROW_FORMATS, encode_row, row_format
from .grpo import GRPOData, collate_prompts
from .kto import KTOData, collate_unpaired
from .packing import PackStats, collate, pack_rows
from .preprocess import RowFormat, Section, preset_sections, render_example
from .pretrain import PretrainData
from .rows import DataError
from .sft import SFTData
from .sources import Arithmetic
from .synthetic import Problem, accuracy, exact_match, extract_answer, synthetic_dataset
from .windows import WindowedLoader, windowed

__all__ = [
    "PretrainData", "SFTData", "DPOData", "GRPOData", "KTOData", "RowsData", "Arithmetic",
    "DataError", "Section", "preset_sections", "encode_row", "render_example",
    "RowFormat", "ROW_FORMATS", "row_format",
    "pack_rows", "PackStats", "collate", "collate_pairs", "collate_prompts", "collate_unpaired",
    "WindowedLoader", "windowed",
    "Problem", "synthetic_dataset", "extract_answer", "exact_match", "accuracy",
]
