"""config.json fields of the attention pattern, both ways: sliding windows and layer types for every family,
and what Gemma 2 / Gemma 3 (text) add (query_pre_attn_scalar, soft-caps, dual RoPE base, GeGLU).

Which layers slide, as transformers decides it when a file has no `layer_types`:

- mistral, mixtral, phi3: every layer, when `sliding_window` is set;
- qwen3_moe: every layer, when `use_sliding_window`;
- qwen2, qwen3: layers i >= `max_window_layers` (default 28), when `use_sliding_window`;
- qwen2_moe: even layers i < `max_window_layers`, when `use_sliding_window`;
- gemma2: even layers (0, 2, …); gemma3_text: all but every `sliding_window_pattern`-th (default 6).

A file's own `layer_types` wins where transformers reads it (qwen2, qwen3, qwen2_moe, gemma2, gemma3_text).
"""

from __future__ import annotations

from typing import Any

from .config import GEMMA_TYPES, ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPED = ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text")  # transformers reads their layer_types
ALL_SLIDING = ("mistral", "mixtral", "qwen3_moe", "phi3")  # one window for every layer, or none
_GEMMA = dict(vocab_size=256000, head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
              eos_token_id=1, bos_token_id=2, query_pre_attn_scalar=256, sliding_window=4096,
              hidden_activation="gelu_pytorch_tanh", attention_bias=False, use_bidirectional_attention=False)
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {  # Gemma2Config / Gemma3TextConfig (5.x)
    "gemma2": {**_GEMMA, "max_position_embeddings": 8192, "rope_theta": 10000.0, "num_key_value_heads": 4,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_GEMMA, "vocab_size": 262208, "max_position_embeddings": 131072, "rope_theta": 1e6,
                    "num_key_value_heads": 4, "rope_local_base_freq": 10000.0, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "sliding_window_pattern": 6},
}


class Refused(ValueError):
    """Raised with the key and the fix; hf_config turns it into UnsupportedCheckpointError naming the file."""


def _refuse(key: str, value: Any, why: str, fix: str) -> None:
    raise Refused(f"key {key!r} is {value!r}: {why}. Fix: {fix}.")


# -- reading ----------------------------------------------------------------------------------------------
def _default_layer_types(mt: str, raw: dict[str, Any], n: int, window: int | None) -> list[str] | None:
    if window is None or mt in ALL_SLIDING or mt == "llama":
        return None
    if mt in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", 28)
        return [SLIDING if i >= first else FULL for i in range(n)]
    if mt == "qwen2_moe":
        last = raw.get("max_window_layers", 28)
        return [SLIDING if (i + 1) % 2 and i < last else FULL for i in range(n)]
    if mt == "gemma2":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    pattern = raw.get("sliding_window_pattern") or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


def window_fields(mt: str, raw: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types of a config.json (defaults already merged into `raw`)."""
    window = raw.get("sliding_window") or None
    if mt == "llama" or mt.startswith("qwen") and not raw.get("use_sliding_window"):
        window = None
    if window is None:
        return dict(sliding_window=None, layer_types=None)
    types = raw.get("layer_types") if mt in LAYER_TYPED else None
    if types is None:
        types = _default_layer_types(mt, raw, raw["num_hidden_layers"], window)
    return dict(sliding_window=window, layer_types=list(types) if types is not None else None)


def gemma_raw(mt: str, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with Gemma's defaults merged in and Gemma 3's per-layer-type `rope_parameters` split into the
    global RoPE (rope_parameters) and `rope_local_base_freq`; the sliding layers' RoPE must be unscaled."""
    raw = {**GEMMA_DEFAULTS[mt], **raw}
    raw["hidden_act"] = raw.get("hidden_activation") or raw.get("hidden_act")
    params = raw.get("rope_parameters")
    if mt == "gemma3_text" and isinstance(params, dict) and isinstance(params.get(FULL), dict):
        local = params.get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            _refuse("rope_parameters", params, "the sliding layers' RoPE is scaled; only their base is read",
                    'give the sliding_attention entry {"rope_type": "default", "rope_theta": ...}')
        raw["rope_parameters"] = params[FULL]
        raw["rope_local_base_freq"] = local.get("rope_theta", raw["rope_local_base_freq"])
    return raw


def gemma_fields(mt: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The Gemma fields of a config.json passed through `gemma_raw`; what this decoder lacks is refused."""
    if raw.get("use_bidirectional_attention"):
        _refuse("use_bidirectional_attention", True, "the decoder here is causal only", "set it false")
    if raw.get("attention_bias"):
        _refuse("attention_bias", True, "Gemma's bias sits on o_proj too, which the decoder lacks",
                "use a checkpoint without attention biases")
    if mt == "gemma3_text" and raw.get("attn_logit_softcapping") is not None:
        _refuse("attn_logit_softcapping", raw["attn_logit_softcapping"], "transformers' Gemma 3 never applies it, "
                "so the checkpoint's meaning is ambiguous", "set it null (as every Gemma 3 checkpoint does)")
    fields = {k: raw.get(k) for k in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")}
    fields["rope_local_base_freq"] = raw.get("rope_local_base_freq") if mt == "gemma3_text" else None
    return fields


# -- writing ----------------------------------------------------------------------------------------------
def _sliding_layers(cfg: ModelConfig) -> list[bool]:
    return [cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)]


def export_problems(cfg: ModelConfig) -> list[str]:
    """What of the attention pattern transformers' class for cfg.model_type would compute otherwise."""
    mt, sliding, problems = cfg.model_type, _sliding_layers(cfg), []
    if any(sliding) and mt == "llama":
        problems.append(f"sliding_window={cfg.sliding_window} (llama has no sliding window)")
    if mt in ALL_SLIDING and any(sliding) and not all(sliding):
        problems.append(f"layer_types with full layers ({mt} slides every layer or none)")
    gemma = mt in GEMMA_TYPES
    if not gemma:
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_base_freq"):
            if getattr(cfg, name) is not None:
                problems.append(f"{name}={getattr(cfg, name)} ({mt} has none; gemma2/gemma3_text have it)")
    if mt == "gemma2" and cfg.rope_local_base_freq is not None:
        problems.append("rope_local_base_freq (gemma2 has one RoPE base)")
    if mt == "gemma3_text" and cfg.attn_logit_softcapping is not None:
        problems.append("attn_logit_softcapping (transformers' Gemma 3 does not apply it)")
    if gemma and cfg.qk_norm != (mt == "gemma3_text"):
        problems.append(f"qk_norm={cfg.qk_norm} (only gemma3_text has q/k norms)")
    return problems


def attention_json(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys of cfg's sliding windows and, for Gemma, its own fields."""
    mt, sliding = cfg.model_type, _sliding_layers(cfg)
    window = cfg.sliding_window if any(sliding) else None
    out: dict[str, Any] = {}
    if mt != "llama":
        out["sliding_window"] = window
    if mt.startswith("qwen"):
        out["use_sliding_window"] = window is not None
        out["max_window_layers"] = sliding.index(True) if mt != "qwen2_moe" and any(sliding) else cfg.num_hidden_layers
    if mt in LAYER_TYPED:
        out["layer_types"] = [SLIDING if s else FULL for s in sliding]
    if mt in GEMMA_TYPES:
        out.update(hidden_activation=cfg.hidden_act, query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_size,
                   attn_logit_softcapping=cfg.attn_logit_softcapping,
                   final_logit_softcapping=cfg.final_logit_softcapping, attention_bias=False,
                   use_bidirectional_attention=False)
        out["sliding_window"] = cfg.sliding_window or GEMMA_DEFAULTS[mt]["sliding_window"]  # unused if no layer slides
        if mt == "gemma3_text":
            out["rope_local_base_freq"] = cfg.rope_local_base_freq or cfg.rope_theta
    return out


def gemma3_rope_json(cfg: ModelConfig, rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's `rope_parameters` per layer type (5.x) beside the older top-level keys `rope` holds."""
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq or cfg.rope_theta}
    return {**rope, "rope_parameters": {FULL: rope["rope_parameters"], SLIDING: local}}

