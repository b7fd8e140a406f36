"""Weight names: Hugging Face safetensors keys ⇄ this decoder's state_dict keys.

Our names are HF's with the `model.` prefix stripped (`lm_head.weight` has none). The exceptions:

- Mixtral keeps its MoE under `block_sparse_moe.` with experts named `w1` (gate), `w3` (up) and
  `w2` (down); ours are `mlp.` and `gate_proj`/`up_proj`/`down_proj`, as in Qwen-MoE.
- transformers 5 holds experts fused in memory, `mlp.experts.gate_up_proj` (E, 2·I, H) with the gate
  rows first and `mlp.experts.down_proj` (E, H, I). Its `save_pretrained` converts them back to the
  per-expert hub layout, but files with the fused tensors exist too; both are read, and each fused
  tensor is split into per-expert matrices. Writing always uses the per-expert hub layout.
- Phi-3 fuses each layer's projections: `self_attn.qkv_proj` holds the q, k and v rows in that order, and
  `mlp.gate_up_proj` the gate rows then the up rows. Loading splits them into our q/k/v_proj and gate/up_proj
  (each a copy of its rows); writing joins them back.
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
from .hf_config import WeightShapeError

_MIXTRAL_TO_OURS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OURS_TO_MIXTRAL = {v: k for k, v in _MIXTRAL_TO_OURS.items()}
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")
_MIXTRAL_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts\.\d+)\.(w[123])\.weight")
_FUSED_EXPERTS = re.compile(r"(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
_RWKV_TO_OURS = {"rwkv.embeddings.": "embed_tokens.", "rwkv.blocks.": "layers.", "rwkv.ln_out.": "norm.",
                 "head.": "lm_head."}
_OURS_TO_RWKV = {v: k for k, v in _RWKV_TO_OURS.items()}
_RWKV_MIX = re.compile(r"layers\.\d+\.(attention|feed_forward)\.time_mix_\w+")
_PHI3_FUSED = re.compile(r"(layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")
_PHI3_PART = re.compile(r"layers\.\d+\.(?:self_attn\.([qkv])_proj|mlp\.(gate|up)_proj)\.weight")


@dataclass(frozen=True)
class Source:
    """Where one of our tensors lives: `key` in safetensors `file`, or one expert's rows of a fused tensor."""

    file: Path
    key: str  # the Hugging Face key
    shape: tuple[int, ...]  # shape of our tensor once taken
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.expert is None and self.rows is None:
            return tensor.reshape(self.shape)  # the same shape but for RWKV's (1, 1, H) token-shift μ
        if self.expert is not None:
            tensor = tensor[self.expert]
        if self.rows is not None:
            tensor = tensor[self.rows[0]:self.rows[1]]
        return tensor.clone()  # no storage shared with the other experts (or the other parts of a fused tensor)


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


def _phi3_sources(file: Path, hf_key: str, key: str, shape: tuple[int, ...], cfg: ModelConfig) -> dict[str, Source]:
    """Phi-3's fused qkv_proj (q, k, v rows) or gate_up_proj (gate, up rows) as our separate projections."""
    m = _PHI3_FUSED.fullmatch(key)
    if m is None or len(shape) != 2:
        return {key: Source(file, hf_key, shape)}
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.num_key_value_heads * cfg.head_size
    parts = ({"q_proj": q, "k_proj": kv, "v_proj": kv} if m[2].startswith("self_attn") else
             {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size})
    if shape[0] != sum(parts.values()):
        raise WeightShapeError(
            f"{file}: {hf_key!r} has {shape[0]} rows, expected {sum(parts.values())} "
            f"({' + '.join(f'{v} {k}' for k, v in parts.items())}). Fix: make config.json match the weights "
            "(head counts, head_dim, hidden_size, intermediate_size).")
    sources, lo, module = {}, 0, m[2].split(".")[0]
    for name, rows in parts.items():
        sources[f"{m[1]}.{module}.{name}.weight"] = Source(file, hf_key, (rows, shape[1]), rows=(lo, lo + rows))
        lo += rows
    return sources


def _phi3_fused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each layer's q/k/v_proj joined into qkv_proj and gate/up_proj into gate_up_proj."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _PHI3_PART.fullmatch(key)
        if m is None:
            out[key] = tensor
            continue
        fused = hf_name(key, "phi3").removeprefix("model.")
        parts.setdefault(fused, {})[m[1] or m[2]] = tensor
        order = ("q", "k", "v") if m[1] else ("gate", "up")
        if len(parts[fused]) == len(order):
            out[fused] = torch.cat([parts[fused][p] for p in order])
    return out


def _renamed(key: str, names: dict[str, str]) -> str:
    """`key` with the first prefix in `names` replaced by its value (unchanged when none matches)."""
    prefix = next((p for p in names if key.startswith(p)), None)
    return key if prefix is None else names[prefix] + key.removeprefix(prefix)


def sources_for(file: Path, hf_key: str, shape: tuple[int, ...], model_type: str = "llama",
                cfg: ModelConfig | None = None) -> dict[str, Source]:
    """Our state_dict keys that HF tensor `hf_key` (of `shape`, stored in `file`) provides; Phi-3's fused tensors
    need the model's `cfg` to be split."""
    if model_type == "rwkv":
        key = _renamed(hf_key, _RWKV_TO_OURS)
        flat = _RWKV_MIX.fullmatch(key) and len(shape) == 3 and shape[:2] == (1, 1)
        return {key: Source(file, hf_key, shape[2:] if flat else shape)}
    key = hf_key.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    if model_type == "phi3":
        assert cfg is not None, "phi3 checkpoints are split by their config"
        return _phi3_sources(file, hf_key, key, shape, cfg)
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
    if model_type == "phi3":
        key = re.sub(r"\.self_attn\.[qkv]_proj\.", ".self_attn.qkv_proj.", key)
        key = re.sub(r"\.mlp\.(gate|up)_proj\.", ".mlp.gate_up_proj.", key)
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
    state = model.state_dict()
    for key, tensor in (_phi3_fused(state) if cfg.model_type == "phi3" else state).items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if cfg.model_type == "rwkv" and _RWKV_MIX.fullmatch(key):
            tensor = tensor.reshape(1, 1, -1)
        yield hf_name(key, cfg.model_type), tensor
        if cfg.model_type == "qwen2" and not cfg.attention_bias and key.endswith(("q_proj.weight", "k_proj.weight",
                                                                                     "v_proj.weight")):
            yield hf_name(key[: -len("weight")] + "bias", cfg.model_type), tensor.new_zeros(tensor.shape[0])
