"""Translate a Hugging Face `config.json` to a ModelConfig and back, and the errors of the HF round-trip.

Reading accepts both layouts of the rotary settings: the older one with `rope_theta` and
`rope_scaling` at the top level (transformers 4.x), and the newer `rope_parameters` dict that
transformers 5 writes (`{"rope_type": ..., "rope_theta": ..., "factor": ...}`). A field missing
from the file takes the default of the transformers config class of that `model_type`, so a file
means here what it means to `transformers`. Writing emits both layouts, so 4.x and 5.x read it.

An `rwkv` config.json (RwkvConfig) has no attention fields: `context_length` is our max_position_embeddings,
`intermediate_size` defaults to 4·hidden_size, and `attention_hidden_size` must equal hidden_size (the state
transformers keeps has hidden_size channels for every tensor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import GEMMA_TYPES, MODEL_TYPES, ConfigError, ModelConfig, finite_number
from .hf_attention import (
    GEMMA_DEFAULTS,
    Refused,
    attention_json,
    export_problems,
    gemma3_rope_json,
    gemma_fields,
    gemma_raw,
    window_fields,
)


class CheckpointError(ValueError):
    """A checkpoint directory does not describe a model this package can hold."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The directory, its config.json or one of its weight files does not exist."""


class UnsupportedCheckpointError(CheckpointError):
    """config.json names an architecture or option the decoder does not implement."""


class MissingWeightError(CheckpointError):
    """A weight that config.json requires is absent from the safetensors files."""


class UnexpectedWeightError(CheckpointError):
    """The safetensors files hold a weight the configured model has no place for."""


class WeightShapeError(CheckpointError):
    """A weight's shape disagrees with the shape config.json implies."""


class NonFiniteWeightError(CheckpointError):
    """A weight holds NaN or infinite values (a damaged file, or one saved after training diverged)."""


class ExportError(ValueError):
    """A model cannot be written as its `model_type` (transformers would compute something else)."""


ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "rwkv": "RwkvForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
}
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
EXPERTS_KEY = {"mixtral": "num_local_experts"}  # qwen3_moe files say num_experts (hub) or num_local_experts (5.x)
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "olmo2")

# Defaults of the transformers config classes (5.x) for the fields a file may omit.
_COMMON = dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02,
               hidden_act="silu", head_dim=None, pad_token_id=None, sliding_window=None)
_MISTRAL = dict(max_position_embeddings=131072, num_key_value_heads=8, bos_token_id=1, eos_token_id=2)
_QWEN = dict(max_position_embeddings=32768, num_key_value_heads=32, bos_token_id=None, eos_token_id=None)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "max_position_embeddings": 2048, "num_key_value_heads": None,
              "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {**_COMMON, **_MISTRAL, "sliding_window": 4096},
    "mixtral": {**_COMMON, **_MISTRAL, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_local_experts": 8,
                "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
    "qwen2": {**_COMMON, **_QWEN},
    "qwen3": {**_COMMON, **_QWEN, "head_dim": 128},
    "qwen2_moe": {**_COMMON, **_QWEN, "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "norm_topk_prob": False, "qkv_bias": True, "router_aux_loss_coef": 0.001},
    "qwen3_moe": {**_COMMON, **_QWEN, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False, "router_aux_loss_coef": 0.001},
    "phi3": {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "num_key_value_heads": None,
             "original_max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 32000,
             "pad_token_id": 32000, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "olmo2": {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "num_key_value_heads": None,
              "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1, "attention_dropout": 0.0},
    **{mt: {**_COMMON, **GEMMA_DEFAULTS[mt]} for mt in GEMMA_TYPES},
}
_RWKV = dict(context_length=1024, attention_hidden_size=None, intermediate_size=None, layer_norm_epsilon=1e-5,
             bos_token_id=0, eos_token_id=0, pad_token_id=None, rescale_every=6, tie_word_embeddings=False,
             initializer_range=0.02)  # RwkvConfig's defaults
_RWKV_COPIED = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_norm_epsilon", "rescale_every",
                "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_COPIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
           "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")


# -- reading ----------------------------------------------------------------------------------------------
def _number(value: Any, key: str, file: Path) -> float:
    """`value` as a finite float, else a CheckpointError naming `key` of `file`."""
    number = finite_number(value)
    if number is None:
        raise CheckpointError(f"{file}: key {key!r} is {value!r}. Fix: give a finite number (e.g. 10000.0), "
                              "without quotes.")
    return number


def read_rope(raw: dict[str, Any], defaults: dict[str, Any], file: Path) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either layout; scaling is None for plain RoPE."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}  # transformers' precedence
    if not isinstance(params, dict):
        raise CheckpointError(f"{file}: key 'rope_scaling' (or 'rope_parameters') is {params!r}. Fix: give an "
                              'object such as {"rope_type": "linear", "factor": 2.0}, or null.')
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedCheckpointError(
            f"{file}: 'rope_parameters' has per-layer-type entries {sorted(params)}; only one RoPE for all "
            "layers is supported. Fix: use a checkpoint of one of the supported architectures.")
    theta = _number(params.pop("rope_theta", None) or raw.get("rope_theta") or defaults["rope_theta"],
                    "rope_theta", file)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0
    partial = _number(partial, "partial_rotary_factor", file)
    if partial != 1.0 and raw.get("model_type") != "phi3":
        raise UnsupportedCheckpointError(
            f"{file}: key 'partial_rotary_factor' != 1 is read for phi3 only (transformers' "
            f"{raw.get('model_type')} rotates whole heads). Fix: use a checkpoint that rotates whole heads.")
    partial_rotary = {"partial_rotary_factor": partial} if partial != 1.0 else {}
    if raw.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # the names of older Phi-3 files; transformers reads both as longrope
    if kind == "longrope":  # a top-level original length wins, as in transformers (every Phi-3 config has one)
        params["original_max_position_embeddings"] = (raw.get("original_max_position_embeddings")
                                                      or params.get("original_max_position_embeddings")
                                                      or raw.get("max_position_embeddings"))
    if kind == "default":
        return theta, {"rope_type": "default", **partial_rotary} if partial_rotary else None
    if kind in ("llama3", "yarn") and not params.get("original_max_position_embeddings"):
        # transformers falls back to max_position_embeddings for these two.
        params["original_max_position_embeddings"] = raw.get("max_position_embeddings")
    return theta, {"rope_type": kind, **params, **partial_rotary}


def _moe_fields(mt: str, raw: dict[str, Any]) -> dict[str, Any]:
    if mt not in MOE_TYPES:
        return {}
    fields = dict(num_experts=raw[EXPERTS_KEY.get(mt, "num_experts")],
                  num_experts_per_tok=raw["num_experts_per_tok"], router_aux_loss_coef=raw["router_aux_loss_coef"])
    if mt == "mixtral":  # every layer is MoE; intermediate_size is the width of one expert
        return {**fields, "moe_intermediate_size": raw["intermediate_size"], "norm_topk_prob": True}
    fields.update(moe_intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=raw["norm_topk_prob"],
                  decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
                  mlp_only_layers=list(raw.get("mlp_only_layers") or []))
    if mt == "qwen2_moe":
        shared = raw["shared_expert_intermediate_size"]
        fields.update(num_shared_experts=1 if shared else 0, shared_expert_intermediate_size=shared,
                      shared_expert_gate=bool(shared))
    return fields


def _attention_fields(mt: str, raw: dict[str, Any], file: Path) -> dict[str, Any]:
    if mt in ("llama", "qwen3", "qwen3_moe", "olmo2") and raw.get("attention_bias"):
        raise UnsupportedCheckpointError(
            f"{file}: key 'attention_bias' is true for {mt}, which puts a bias on o_proj too; the decoder "
            "only has q/k/v biases. Fix: use a checkpoint without attention biases.")
    if mt == "llama" and raw.get("mlp_bias"):
        raise UnsupportedCheckpointError(
            f"{file}: key 'mlp_bias' is true; the SwiGLU MLP here has no biases. "
            "Fix: use a checkpoint without MLP biases.")
    bias = {"qwen2": True, "qwen2_moe": bool(raw.get("qkv_bias"))}.get(mt, False)
    try:
        gemma = gemma_fields(mt, raw) if mt in GEMMA_TYPES else {}
    except Refused as err:
        raise UnsupportedCheckpointError(f"{file}: {err}") from None
    return dict(attention_bias=bias, qk_norm=mt in QK_NORM_TYPES, **window_fields(mt, raw), **gemma)


def _check_phi3_olmo2(mt: str, raw: dict[str, Any], scaling: dict | None, file: Path) -> None:
    """Refuse what transformers' Phi-3 and OLMo 2 would compute from `raw` and the decoder here cannot."""
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop"):
        if _number(raw.get(key) or 0, key, file) != 0:
            raise UnsupportedCheckpointError(
                f"{file}: key {key!r} is {raw[key]!r}; the decoder here has no dropout. Fix: set it to 0.0 "
                "(dropout only regularises training; the weights are the same).")
    if mt == "phi3" and scaling is not None and scaling["rope_type"] not in ("default", "longrope"):
        raise UnsupportedCheckpointError(
            f"{file}: key 'rope_scaling' has rope_type {scaling['rope_type']!r}; Phi-3 reads only longrope (or "
            "none). Fix: give rope_type longrope with short_factor and long_factor, or null.")
    if mt == "olmo2" and raw.get("sliding_window") is not None:
        raise UnsupportedCheckpointError(
            f"{file}: key 'sliding_window' is {raw['sliding_window']!r}; OLMo 2 attends to the whole context "
            "(transformers' Olmo2 has no window). Fix: remove the key or set it to null.")


def _model_config(fields: dict[str, Any], file: Path) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as err:
        raise UnsupportedCheckpointError(f"{file}: {err}") from err


def _rwkv_config(raw: dict[str, Any], file: Path) -> ModelConfig:
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if raw.get(k) is None]
    if missing:
        raise CheckpointError(f"{file}: required key {missing[0]!r} is missing. Fix: add it (every config.json "
                              "that transformers writes has it).")
    raw = {**_RWKV, **raw}
    hidden, attention = raw["hidden_size"], raw["attention_hidden_size"]
    if attention is not None and attention != hidden:
        raise UnsupportedCheckpointError(
            f"{file}: key 'attention_hidden_size' is {attention!r}, not hidden_size={hidden!r}; the time mix "
            "here is as wide as the residual stream. Fix: use a checkpoint with attention_hidden_size = hidden_size.")
    fields = {k: raw[k] for k in _RWKV_COPIED}
    width = raw["intermediate_size"] or (4 * hidden if isinstance(hidden, int) else None)  # types: ModelConfig
    fields.update(model_type="rwkv", intermediate_size=width,
                  max_position_embeddings=raw.get("max_position_embeddings") or raw["context_length"],
                  torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"))
    return _model_config(fields, file)


def config_from_hf(raw: dict[str, Any], file: Path) -> ModelConfig:
    """The ModelConfig a Hugging Face config.json (already parsed) describes; `file` is named in errors."""
    mt = raw.get("model_type")
    if mt not in MODEL_TYPES:
        raise UnsupportedCheckpointError(
            f"{file}: key 'model_type' is {mt!r}, which this package cannot load. "
            f"Fix: use a checkpoint whose model_type is one of {', '.join(MODEL_TYPES)}.")
    if mt == "rwkv":
        return _rwkv_config(raw, file)
    missing = [k for k in _REQUIRED if raw.get(k) is None]
    if missing:
        raise CheckpointError(
            f"{file}: required key {missing[0]!r} is missing. Fix: add it (every config.json that "
            "transformers writes has it).")
    key = EXPERTS_KEY.get(mt, "num_experts")
    alias = "num_experts" if key == "num_local_experts" else "num_local_experts"
    if key not in raw and alias in raw:
        raw = {**raw, key: raw[alias]}
    raw = {**DEFAULTS[mt], **raw}
    if mt in GEMMA_TYPES:
        try:
            raw = gemma_raw(mt, raw)
        except Refused as err:
            raise UnsupportedCheckpointError(f"{file}: {err}") from None
    theta, scaling = read_rope(raw, DEFAULTS[mt], file)
    if mt in ("phi3", "olmo2"):
        _check_phi3_olmo2(mt, raw, scaling, file)
    fields = {k: raw[k] for k in _COPIED}
    fields.update(model_type=mt, rope_theta=theta, rope_scaling=scaling,
                  torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
                  **_attention_fields(mt, raw, file), **_moe_fields(mt, raw))
    return _model_config(fields, file)


# -- writing ----------------------------------------------------------------------------------------------
def check_exportable(cfg: ModelConfig) -> None:
    """Raise ExportError when transformers' class for cfg.model_type would not compute what this model does."""
    mt, problems = cfg.model_type, []
    if mt not in MOE_TYPES and cfg.num_experts:
        problems.append(f"num_experts={cfg.num_experts} ({mt} has no MoE layers)")
    if mt == "mixtral" and not cfg.num_experts:
        problems.append("num_experts=0 (every mixtral layer is MoE)")
    if cfg.qk_norm != (mt in QK_NORM_TYPES):
        problems.append(f"qk_norm={cfg.qk_norm} ({mt} {'always has' if mt in QK_NORM_TYPES else 'has no'} q/k norms)")
    if cfg.attention_bias and mt not in ("qwen2", "qwen2_moe"):
        problems.append(f"attention_bias=True ({mt} has no q/k/v-only bias)")
    if mt == "mixtral" and (cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers):
        problems.append("dense layers (mixtral makes every layer MoE)")
    if mt == "mixtral" and not cfg.norm_topk_prob:
        problems.append("norm_topk_prob=False (mixtral always renormalises)")
    shared = cfg.shared_expert_intermediate_size
    if mt == "qwen2_moe" and cfg.num_experts and not (shared and cfg.shared_expert_gate):
        problems.append("no gated shared expert (qwen2_moe always has one)")
    if mt != "qwen2_moe" and shared:
        problems.append(f"shared experts ({mt} has none)")
    if mt != "phi3" and cfg.partial_rotary_factor != 1.0:
        problems.append(f"partial_rotary_factor={cfg.partial_rotary_factor} ({mt} rotates whole heads)")
    if mt == "phi3" and cfg.rope_type not in ("default", "longrope"):
        problems.append(f"rope_type={cfg.rope_type!r} (phi3 reads only longrope)")
    if mt == "olmo2" and cfg.sliding_window is not None:
        problems.append(f"sliding_window={cfg.sliding_window} (olmo2 has no sliding window)")
    problems += export_problems(cfg)
    if problems:
        raise ExportError(f"ModelConfig(model_type={mt!r}) cannot be written as {ARCHITECTURES[mt]}: "
                          f"{'; '.join(problems)}. Fix: change model_type to an architecture that has "
                          "these features, or change the fields.")


def _rope_json(cfg: ModelConfig) -> dict[str, Any]:
    scaling = dict(cfg.rope_scaling) if cfg.rope_type != "default" else None
    if scaling is not None:
        scaling.pop("type", None)
        scaling["rope_type"] = cfg.rope_type
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta}
    out = {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}
    if cfg.partial_rotary_factor != 1.0:  # both layouts: inside rope_parameters (5.x), at the top level (4.x)
        params["partial_rotary_factor"] = out["partial_rotary_factor"] = cfg.partial_rotary_factor
    return out


def _moe_json(cfg: ModelConfig) -> dict[str, Any]:
    mt = cfg.model_type
    if mt == "mixtral":
        return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                    intermediate_size=cfg.moe_intermediate_size, router_aux_loss_coef=cfg.router_aux_loss_coef)
    out = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
               decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
               router_aux_loss_coef=cfg.router_aux_loss_coef)
    if mt == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=cfg.attention_bias)
    return out


def _phi3_olmo2_json(cfg: ModelConfig) -> dict[str, Any]:
    """No dropout; Phi-3's top-level original length (transformers lets it override the one in rope_scaling)."""
    if cfg.model_type == "olmo2":
        return dict(attention_bias=False, attention_dropout=0.0)
    original = (cfg.rope_scaling or {}).get("original_max_position_embeddings") if cfg.rope_type == "longrope" else None
    return dict(attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                original_max_position_embeddings=original or cfg.max_position_embeddings)


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """The config.json dict for cfg (call check_exportable first); `dtype` names the stored tensors' dtype."""
    mt = cfg.model_type
    out: dict[str, Any] = {"architectures": [ARCHITECTURES[mt]], "model_type": mt}
    if mt == "rwkv":
        out.update({k: getattr(cfg, k) for k in _RWKV_COPIED})
        out.update(intermediate_size=cfg.intermediate_size, attention_hidden_size=cfg.hidden_size,
                   context_length=cfg.max_position_embeddings, dtype=dtype, torch_dtype=dtype, use_cache=True)
        return out
    out.update({k: getattr(cfg, k) for k in _COPIED})
    rope = _rope_json(cfg)
    out.update(head_dim=cfg.head_size, num_key_value_heads=cfg.num_key_value_heads,
               **(gemma3_rope_json(cfg, rope) if mt == "gemma3_text" else rope))
    if mt in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if mt == "llama":
        out["mlp_bias"] = False
    if mt in ("phi3", "olmo2"):
        out.update(_phi3_olmo2_json(cfg))
    out.update(attention_json(cfg))
    if mt in MOE_TYPES:
        out.update(_moe_json(cfg))
    out.update(dtype=dtype, torch_dtype=dtype, use_cache=True)
    return out


def generation_config(cfg: ModelConfig, end_ids: list[int] | tuple[int, ...] = ()) -> dict[str, Any]:
    """generation_config.json: `eos_token_id` lists the model's end ids and `end_ids` (the tokenizer's end of
    turn), so `transformers` and vLLM stop where a turn ends; one id is written as a plain int."""
    eos = list(dict.fromkeys([*cfg.eos_token_ids, *end_ids]))
    out = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
           "_from_model_config": True}
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    return out
