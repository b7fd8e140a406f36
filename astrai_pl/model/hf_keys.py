"""Weight names: Hugging Face safetensors keys ⇄ this decoder's state_dict keys.

Our names are HF's with the `model.` prefix stripped (`lm_head.weight` has none). The exceptions:

- Mixtral keeps its MoE under `block_sparse_moe.` with experts named `w1` (gate), `w3` (up) and
  `w2` (down); ours are `mlp.` and `gate_proj`/`up_proj`/`down_proj`, as in Qwen-MoE.
- transformers 5 holds experts fused in memory, `mlp.experts.gate_up_proj` (E, 2·I, H) with the gate
  rows first and `mlp.experts.down_proj` (E, H, I). Its `save_pretrained` converts them back to the
  per-expert hub layout, but files with the fused tensors exist too; both are read, and each fused
  tensor is split into per-expert matrices. Writing always uses the per-expert hub layout.
- Old Llama checkpoints carry `rotary_emb.inv_freq` buffers; they are recomputed, so ignored.
- RWKV (`rwkv.py`) keeps transformers' names below the block (`pre_ln`, `ln1`, `attention.time_decay`,
  `feed_forward.key`, …); around them `rwkv.embeddings` is our `embed_tokens`, `rwkv.blocks` our `layers`,
  `rwkv.ln_out` our `norm` and `head` our `lm_head`. The token-shift μ (`time_mix_*`) are (1, 1, H) in
  its files and 1-D here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig

_MIXTRAL_TO_OURS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OURS_TO_MIXTRAL = {v: k for k, v in _MIXTRAL_TO_OURS.items()}
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")
_MIXTRAL_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts\.\d+)\.(w[123])\.weight")
_FUSED_EXPERTS = re.compile(r"(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
_RWKV_TO_OURS = {"rwkv.embeddings.": "embed_tokens.", "rwkv.blocks.": "layers.", "rwkv.ln_out.": "norm.",
                 "head.": "lm_head."}
_OURS_TO_RWKV = {v: k for k, v in _RWKV_TO_OURS.items()}
_RWKV_MIX = re.compile(r"layers\.\d+\.(attention|feed_forward)\.time_mix_\w+")


@dataclass(frozen=True)
class Source:
    """Where one of our tensors lives: `key` in safetensors `file`, or one expert's rows of a fused tensor."""

    file: Path
    key: str  # the Hugging Face key
    shape: tuple[int, ...]  # shape of our tensor once taken
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.expert is None:
            return tensor.reshape(self.shape)  # the same shape but for RWKV's (1, 1, H) token-shift μ
        tensor = tensor[self.expert]
        if self.rows is not None:
            tensor = tensor[self.rows[0]:self.rows[1]]
        return tensor.clone()  # no storage shared with the other experts


def is_ignored(hf_key: str) -> bool:
    return bool(_IGNORED.fullmatch(hf_key))


def _fused_sources(file: Path, hf_key: str, prefix: str, kind: str, shape: tuple[int, ...]) -> dict[str, Source]:
    """Split a fused (E, 2·I, H) gate_up_proj or (E, H, I) down_proj into per-expert sources."""
    experts, rows, cols = shape
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": Source(file, hf_key, (rows, cols), e) for e in range(experts)}
    half = rows // 2
    return {f"{prefix}.{e}.{name}.weight": Source(file, hf_key, (half, cols), e, (lo, lo + half))
            for e in range(experts) for name, lo in (("gate_proj", 0), ("up_proj", half))}


def _renamed(key: str, names: dict[str, str]) -> str:
    """`key` with the first prefix in `names` replaced by its value (unchanged when none matches)."""
    prefix = next((p for p in names if key.startswith(p)), None)
    return key if prefix is None else names[prefix] + key.removeprefix(prefix)


def sources_for(file: Path, hf_key: str, shape: tuple[int, ...], model_type: str = "llama"
                ) -> dict[str, Source]:
    """Our state_dict keys that HF tensor `hf_key` (of `shape`, stored in `file`) provides."""
    if model_type == "rwkv":
        key = _renamed(hf_key, _RWKV_TO_OURS)
        flat = _RWKV_MIX.fullmatch(key) and len(shape) == 3 and shape[:2] == (1, 1)
        return {key: Source(file, hf_key, shape[2:] if flat else shape)}
    key = hf_key.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    if m := _MIXTRAL_EXPERT.fullmatch(key):
        key = f"{m[1]}.{_MIXTRAL_TO_OURS[m[2]]}.weight"
    if (m := _FUSED_EXPERTS.fullmatch(key)) and len(shape) == 3:
        return _fused_sources(file, hf_key, m[1], m[2], shape)
    return {key: Source(file, hf_key, shape)}


def hf_name(key: str, model_type: str) -> str:
    """The Hugging Face key under which our state_dict `key` is written."""
    if model_type == "rwkv":
        return _renamed(key, _OURS_TO_RWKV)
    if key == "lm_head.weight":
        return key
    if model_type == "mixtral" and ".mlp." in key:
        key = key.replace(".mlp.", ".block_sparse_moe.")
        parts = key.split(".")
        if "experts" in parts:
            parts[-2] = _OURS_TO_MIXTRAL[parts[-2]]
        key = ".".join(parts)
    return "model." + key


def export_tensors(model: torch.nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, tensor) for every weight to write; tied lm_head left out, as transformers does.

    Qwen2 always has q/k/v biases; a qwen2 model built without them gets zero biases, which
    compute exactly what no bias does.
    """
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if cfg.model_type == "rwkv" and _RWKV_MIX.fullmatch(key):
            tensor = tensor.reshape(1, 1, -1)
        yield hf_name(key, cfg.model_type), tensor
        if cfg.model_type == "qwen2" and not cfg.attention_bias and key.endswith(("q_proj.weight", "k_proj.weight",
                                                                                     "v_proj.weight")):
            yield hf_name(key[: -len("weight")] + "bias", cfg.model_type), tensor.new_zeros(tensor.shape[0])
