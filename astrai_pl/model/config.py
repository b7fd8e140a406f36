"""ModelConfig: the shape of the shared decoder, with Hugging Face field names, and presets by name."""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "rwkv", "gemma2",
               "gemma3_text", "phi3", "olmo2")
GEMMA_TYPES = ("gemma2", "gemma3_text")  # (1 + w) norms, sandwich norms, scaled embeddings (gemma.py)
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
RECURRENT_TYPES = ("rwkv",)  # blocks with a recurrent mixer (rwkv.py) in place of attention
POST_NORM_TYPES = ("olmo2",)  # norms on the outputs of attention and of the MLP, none on their inputs (olmo2.py)
WIDE_QK_NORM_TYPES = ("olmo2",)  # q/k norms over the whole projected width, not per head


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent with another one."""


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (a bool or a string is not one), else None."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _matches(value: Any, hint: Any) -> bool:
    """Whether `value` has the type `hint` spells (int, float, bool, str, None, dict, list[…], unions)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return finite_number(value) is not None
    return hint is Any or isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "None").replace("<class '", "").replace("'>", "")


@dataclass
class ModelConfig:
    """Shape and numerics of the decoder. Field names follow Hugging Face's `config.json`."""

    model_type: str = "llama"
    """Architecture family written to config.json: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe,
    phi3, olmo2 (norms on the outputs of attention and of the MLP; q/k norms over the whole width), or
    rwkv (RWKV-4 time mix and channel mix in place of attention and the MLP; the attention fields are then unused)."""
    vocab_size: int = 32000
    """Number of token embeddings (rows of embed_tokens and lm_head)."""
    hidden_size: int = 512
    """Width of the residual stream."""
    intermediate_size: int = 1376
    """Hidden width of the dense SwiGLU MLP."""
    num_hidden_layers: int = 8
    """Number of decoder blocks."""
    num_attention_heads: int = 8
    """Query heads per attention layer."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); None means equal to num_attention_heads."""
    head_dim: int | None = None
    """Width of one head; None means hidden_size // num_attention_heads."""
    hidden_act: str = "silu"
    """Activation of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, as Gemma)."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: dict[str, Any] | None = None
    """Context extension: {"rope_type": default|linear|dynamic|llama3|yarn, "factor": ..., ...} as in HF."""
    max_position_embeddings: int = 2048
    """Longest context the rotary tables are built for (the original length for scaled RoPE)."""
    tie_word_embeddings: bool = False
    """Share the input embedding matrix with the output projection."""
    attention_bias: bool = False
    """Bias on the q, k and v projections (Qwen2 has it)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3 has it)."""
    sliding_window: int | None = None
    """Tokens a query of a sliding layer sees, itself included (key j visible from query i when i - j < window);
    None: every layer attends to the whole context."""
    layer_types: list[str] | None = None
    """Per layer, "sliding_attention" (the window) or "full_attention"; None: every layer slides when
    sliding_window is set (Mistral, Mixtral)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar^-0.5 (Gemma); None means head_dim."""
    attn_logit_softcapping: float | None = None
    """Attention scores become cap·tanh(score / cap) before the mask and softmax (Gemma 2); None: no cap."""
    final_logit_softcapping: float | None = None
    """Output logits become cap·tanh(logit / cap) (Gemma 2); None: no cap."""
    rope_local_base_freq: float | None = None
    """RoPE base of the sliding layers (Gemma 3's local layers); None means rope_theta."""
    initializer_range: float = 0.02
    """Standard deviation of the normal initialisation; residual projections are scaled by 1/sqrt(2·layers)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 means every layer is dense."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int | None = None
    """Hidden width of one routed expert; None means intermediate_size."""
    num_shared_experts: int = 0
    """Always-on experts added to every token's routed output (Qwen2-MoE uses one, with a sigmoid gate)."""
    shared_expert_intermediate_size: int | None = None
    """Hidden width of the shared expert block; None means num_shared_experts · moe_intermediate_size."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(Linear(x)) as Qwen2-MoE does."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to one (Mixtral, Qwen3-MoE: yes; Qwen2-MoE: no)."""
    router_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss E·Σ f_e·P_e that objectives add to the task loss."""
    decoder_sparse_step: int = 1
    """Every decoder_sparse_step-th layer is MoE (counting from 1), as in Qwen-MoE configs."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layer indices that stay dense even when MoE is on."""
    bos_token_id: int | None = 1
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = 2
    """End-of-sequence token id (or ids)."""
    pad_token_id: int | None = None
    """Padding token id, if the tokenizer has one."""
    torch_dtype: str = "float32"
    """Dtype recorded in config.json on export."""
    layer_norm_epsilon: float = 1e-5
    """rwkv only: epsilon of the LayerNorms in every block (the final ln_out always uses 1e-5, as transformers)."""
    rescale_every: int = 6
    """rwkv only: in eval mode the residual stream is halved after every rescale_every-th block (and the blocks'
    output projections scaled to match), as transformers does against fp16 overflow; 0 or less: never."""

    def __post_init__(self) -> None:
        self._check_types()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.shared_expert_intermediate_size is None:
            self.shared_expert_intermediate_size = self.num_shared_experts * self.moe_intermediate_size
        self.mlp_only_layers = list(self.mlp_only_layers)
        self._validate()

    def _check_types(self) -> None:
        for name, hint in typing.get_type_hints(type(self)).items():
            value = getattr(self, name)
            if _matches(value, hint):
                continue
            numeric = {int, float} & {hint, *typing.get_args(hint)}
            infinite = isinstance(value, float) and not math.isfinite(value)
            fix = ("write a number, without quotes" if isinstance(value, str) and numeric else
                   "give a finite number" if infinite else f"give a value of type {_type_name(hint)}")
            got = "a non-finite number" if infinite else type(value).__name__
            raise ConfigError(f"ModelConfig.{name}={value!r}: must be {_type_name(hint)}, got {got}; {fix}")

    def _validate(self) -> None:
        def fail(name: str, why: str, fix: str) -> None:
            raise ConfigError(f"ModelConfig.{name}={getattr(self, name)!r}: {why}; {fix}")

        if self.model_type not in MODEL_TYPES:
            fail("model_type", "unknown architecture", f"use one of {', '.join(MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                fail(name, "must be positive", "set a value > 0")
        if self.mixer == "rwkv":
            self._validate_rwkv(fail)
            return
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            fail("num_attention_heads", f"does not divide hidden_size={self.hidden_size}",
                 "pick a head count that divides the width, or set head_dim explicitly")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", f"does not divide num_attention_heads={self.num_attention_heads}",
                 "each key/value head must serve a whole number of query heads")
        if self.head_dim is not None and (self.head_dim <= 0 or self.head_dim % 2):
            fail("head_dim", "must be a positive even number", "RoPE rotates pairs of channels")
        if self.hidden_act not in HIDDEN_ACTS:
            fail("hidden_act", "unknown activation of the gated MLP", f"use one of {', '.join(HIDDEN_ACTS)}")
        self._validate_attention_pattern(fail)
        if self.rms_norm_eps <= 0:
            fail("rms_norm_eps", "must be positive", "use e.g. 1e-6")
        if self.rope_theta <= 0:
            fail("rope_theta", "must be positive", "use e.g. 10000.0")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                fail("rope_scaling", f"unknown rope_type {kind!r}", f"use one of {', '.join(ROPE_TYPES)}")
            partial = self.rope_scaling.get("partial_rotary_factor", 1.0)
            if not (_matches(partial, float) and 0 < partial <= 1 and self.rotary_dim % 2 == 0 < self.rotary_dim):
                fail("rope_scaling", f"partial_rotary_factor={partial!r} must lie in (0, 1] and rotate an even "
                     f"number of a head's {self.head_size} channels", "give e.g. 0.5, or leave it out (1)")
            factor = self.rope_scaling.get("factor", 0)
            if kind not in ("default", "longrope") and not (_matches(factor, float) and factor > 0):
                fail("rope_scaling", "needs a positive 'factor'", "add e.g. factor: 2.0")
            if kind == "longrope":
                self._validate_longrope(fail)
        if self.num_experts < 0:
            fail("num_experts", "must be >= 0", "use 0 for a dense model")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                fail("num_experts_per_tok", f"must lie in 1..num_experts={self.num_experts}",
                     "route each token to at most as many experts as exist")
            if self.decoder_sparse_step < 1:
                fail("decoder_sparse_step", "must be >= 1", "use 1 to make every layer MoE")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            fail("mlp_only_layers", f"layer indices {bad} do not exist",
                 f"use indices in 0..{self.num_hidden_layers - 1}")
        if self.num_shared_experts < 0:
            fail("num_shared_experts", "must be >= 0", "use 0 for none")
        if self.post_norm and (self.num_experts or self.hidden_act != "silu"):
            fail("num_experts" if self.num_experts else "hidden_act",
                 f"{self.model_type} blocks have a dense SwiGLU MLP", "use num_experts=0 and hidden_act='silu'")

    def _validate_attention_pattern(self, fail) -> None:
        """Sliding windows, layer types, score scale and soft-caps: positive where set, one type per layer."""
        if self.sliding_window is not None and self.sliding_window < 1:
            fail("sliding_window", "must be >= 1", "give the window in tokens, or null for full attention")
        if self.layer_types is not None:
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                fail("layer_types", f"unknown layer type(s) {bad}", f"use {' or '.join(LAYER_TYPES)}")
            if len(self.layer_types) != self.num_hidden_layers:
                fail("layer_types", f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
                     "give one entry per layer")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_base_freq"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                fail(name, "must be positive", "give a positive number, or null to turn it off")

    def _validate_longrope(self, fail) -> None:
        """longrope: one short and one long divisor per rotary frequency, an original length, optional factors."""
        scaling, pairs = self.rope_scaling, self.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            value = scaling.get(key)
            if not (_matches(value, list[float]) and len(value) == pairs and all(v > 0 for v in value)):
                fail("rope_scaling", f"longrope needs {key!r}: {pairs} positive numbers (one per frequency of "
                     f"the {self.rotary_dim} rotated channels of a head)", f"give {key} as a list of {pairs} numbers")
        original = scaling.get("original_max_position_embeddings")
        if not (_matches(original, int) and original > 1):
            fail("rope_scaling", "longrope needs 'original_max_position_embeddings' > 1",
                 "give the context length the model was pretrained with")
        for key in ("factor", "attention_factor"):
            if scaling.get(key) is not None and not (_matches(scaling[key], float) and scaling[key] > 0):
                fail("rope_scaling", f"longrope's {key!r} must be a positive number", f"fix or remove {key}")

    def _validate_rwkv(self, fail) -> None:
        """RWKV blocks have no attention and no MoE: a field that would change those is refused, not ignored.
        The head counts, head_dim, RoPE base and rms_norm_eps are unused (harmless at any valid value)."""
        if self.layer_norm_epsilon <= 0:
            fail("layer_norm_epsilon", "must be positive", "use e.g. 1e-5")
        unused = dict(num_experts=0, num_shared_experts=0, attention_bias=False, qk_norm=False, rope_scaling=None,
                      sliding_window=None, mlp_only_layers=[], layer_types=None, query_pre_attn_scalar=None,
                      attn_logit_softcapping=None, final_logit_softcapping=None, rope_local_base_freq=None)
        for name, neutral in unused.items():
            if getattr(self, name) != neutral:
                fail(name, "rwkv blocks have no attention and no experts", f"remove it (or set {neutral!r}), or "
                     "pick an attention model_type")

    # -- derived shape -----------------------------------------------------------------------------------
    @property
    def mixer(self) -> str:
        """What mixes tokens in every block: "rwkv" (recurrent time mix, rwkv.py) or "attention"."""
        return "rwkv" if self.model_type in RECURRENT_TYPES else "attention"

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def is_sliding_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) is a local one: its layer type says so, or, without layer_types,
        a sliding window is set. Local layers take the window and the RoPE base rope_local_base_freq."""
        if self.layer_types is not None:
            return self.layer_types[index] == "sliding_attention"
        return self.sliding_window is not None

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index` (0-based), or None when it attends to the whole context."""
        return self.sliding_window if self.is_sliding_layer(index) else None

    @property
    def attention_scale(self) -> float:
        """The factor on q·k: query_pre_attn_scalar^-0.5, by default head_dim^-0.5."""
        return (self.query_pre_attn_scalar or self.head_size) ** -0.5

    @property
    def is_gemma(self) -> bool:
        """(1 + w) RMSNorms, norms before and after attention and MLP, embeddings scaled by sqrt(hidden)."""
        return self.model_type in GEMMA_TYPES

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder block `index` (0-based) uses the MoE feed-forward."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def partial_rotary_factor(self) -> float:
        """The share of each head's channels RoPE rotates (rope_scaling's partial_rotary_factor; Phi-4-mini: 0.75)."""
        value = (self.rope_scaling or {}).get("partial_rotary_factor", 1.0)
        return float(value) if finite_number(value) is not None else 1.0

    @property
    def rotary_dim(self) -> int:
        """How many leading channels of each head RoPE rotates; the rest pass unchanged."""
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def post_norm(self) -> bool:
        """Whether each block normalises the outputs of attention and of the MLP instead of their inputs (OLMo 2)."""
        return self.model_type in POST_NORM_TYPES

    @property
    def wide_qk_norm(self) -> bool:
        """Whether the q/k RMSNorms span all heads' channels (OLMo 2) rather than each head (Qwen3)."""
        return self.qk_norm and self.model_type in WIDE_QK_NORM_TYPES

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.eos_token_id
        return [] if ids is None else list(ids) if isinstance(ids, (list, tuple)) else [ids]

    def num_parameters(self) -> int:
        """Parameter count, computed from the shape alone (embeddings counted once when tied)."""
        h, d, nq, nkv = self.hidden_size, self.head_size, self.num_attention_heads, self.num_key_value_heads
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        if self.mixer == "rwkv":  # per block: 2 LayerNorms, time mix (5 vectors, 4 matrices), channel mix
            block = 4 * h + (5 * h + 4 * h * h) + (2 * h + h * h + 2 * h * self.intermediate_size)
            return self.num_hidden_layers * block + emb + 2 * h + 2 * h  # + pre_ln, ln_out
        attn = h * d * (nq + 2 * nkv) + nq * d * h + (d * (nq + 2 * nkv) if self.attention_bias else 0)
        attn += ((nq + nkv) * d if self.wide_qk_norm else 2 * d) if self.qk_norm else 0
        dense = 3 * h * self.intermediate_size
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)
        moe += 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gate else 0)
        norms = 4 * h if self.is_gemma else 2 * h  # Gemma: norms before and after attention and the MLP
        blocks = sum(attn + norms + (moe if self.is_moe_layer(i) else dense) for i in range(self.num_hidden_layers))
        return blocks + emb + h

    # -- names -------------------------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig:
        """A preset by name (see PRESETS), with any field overridden."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, dict[str, Any]] = {
    # Fast CPU tests: a few layers, tiny width, GQA on so every code path runs.
    "debug": dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # The demo model: trains on two CPU cores in minutes.
    "tiny": dict(vocab_size=320, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # The RWKV-4 counterparts of debug and tiny: same widths and depths, channel mix 4x wide (RWKV's default).
    "rwkv-debug": dict(model_type="rwkv", vocab_size=320, hidden_size=64, intermediate_size=256,
                       num_hidden_layers=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0),
    "rwkv-tiny": dict(model_type="rwkv", vocab_size=320, hidden_size=192, intermediate_size=768,
                      num_hidden_layers=4, max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # Gemma 2 and Gemma 3 (text) at debug size: alternating local/global layers with a window of 8 (gemma.py).
    "gemma2-debug": dict(model_type="gemma2", vocab_size=320, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         hidden_act="gelu_pytorch_tanh", max_position_embeddings=512, tie_word_embeddings=True,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                         query_pre_attn_scalar=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                         bos_token_id=2, eos_token_id=1, pad_token_id=0),
    "gemma3-debug": dict(model_type="gemma3_text", vocab_size=320, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         hidden_act="gelu_pytorch_tanh", max_position_embeddings=512, tie_word_embeddings=True,
                         sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                         query_pre_attn_scalar=24, qk_norm=True, rope_theta=1000000.0,
                         rope_local_base_freq=10000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None),
    "Qwen2.5-0.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                         tie_word_embeddings=True, attention_bias=True, bos_token_id=151643,
                         eos_token_id=151643, pad_token_id=None),
    "Qwen3-0.6B": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                       tie_word_embeddings=True, qk_norm=True, bos_token_id=151643,
                       eos_token_id=151645, pad_token_id=None),
    "Llama-3.2-1B": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         tie_word_embeddings=True, bos_token_id=128000,
                         eos_token_id=[128001, 128008, 128009], pad_token_id=None),
    # Phi-3 and OLMo 2 at debug size: Phi-3 with LongRoPE (long factors past 256 tokens), OLMo 2 with its norms.
    "phi3-debug": dict(model_type="phi3", vocab_size=320, hidden_size=64, intermediate_size=160,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                       max_position_embeddings=512,
                       rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 256,
                                     "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0],
                                     "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]},
                       bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "olmo2-debug": dict(model_type="olmo2", vocab_size=320, hidden_size=64, intermediate_size=160,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, qk_norm=True,
                        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}
