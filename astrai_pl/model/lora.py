"""LoRA adapters on the shared Transformer (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A targeted projection y = W·x + b becomes

    y = W·x + b + s · B·A·dropout(x),    A: (r, in), B: (out, r),    s = lora_alpha / r   (rsLoRA: lora_alpha / √r)

with W and b frozen and only A and B trained. A starts Kaiming-uniform and B at zero, as in PEFT, so an adapted
model computes exactly what its base does until the first optimizer step.

The field names and meanings are those of PEFT's `LoraConfig`, and the adapter's weights are named as PEFT names
them (`…q_proj.lora_A.weight`), so an adapter trained here is a PEFT adapter (adapter_files.py writes and reads
the directory). A targeted `Linear` is replaced by a `LoraLinear` that holds the *same* weight and bias
parameters, so the base keeps its state-dict keys and its Hugging Face export is unchanged.

`target_modules` as in PEFT: a list of module names, each matching a module whose Hugging Face name is it or ends
in `.` + it; a string, matched as a regular expression against the whole Hugging Face module name (by RE2, in
time linear in the name: look-arounds and back-references are refused); or
`"all-linear"`: every projection of attention and of the dense or shared-expert MLP, never the output layer; None:
PEFT's default for the model type (q_proj and v_proj; RWKV: key, value, receptance, output, which by the suffix
rule name the time mix's four projections and the channel mix's three, as in transformers' `RwkvForCausalLM`:
`attention.key` … `attention.output`, `feed_forward.key|value|receptance`). The routed experts and the router
of a MoE layer are not adapted: Hugging Face stores the experts fused (not as linear layers), so no PEFT
adapter can name them; asking for them is refused.

`modules_to_save` trains whole modules next to the adapters (e.g. `lm_head`, `embed_tokens`), saved in full in
the adapter; their original weights are kept beside them, so that switching the adapters off (the reference
policy of DPO and GRPO) also restores those modules.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from .config import ConfigError
from .layers import Linear
from .trainable_tokens import (
    ROWS_KEY,
    add_trainable_tokens,
    check_token_indices,
    remove_trainable_tokens,
    token_modules,
)

ALL_LINEAR = "all-linear"
DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for llama, mistral, qwen2/3, mixtral
RWKV_TARGETS = ("key", "value", "receptance", "output")  # PEFT's default for rwkv
_NOT_ADAPTABLE = re.compile(r".*\.mlp\.(experts\.\d+\..*|gate)")  # routed experts, router
_FIELD = "model.init_args.lora"
_MAX_PATTERN = 1000  # characters of a target_modules regex


@dataclass
class LoraConfig:
    """A LoRA adapter: PEFT's `LoraConfig` fields, with PEFT's meanings."""

    r: int = 8
    """Rank of the update B·A (PEFT default 8)."""
    lora_alpha: float = 8
    """The update is scaled by lora_alpha / r (lora_alpha / √r with use_rslora)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input during training (the base path is never dropped)."""
    target_modules: list[str] | str | None = None
    """Which projections get an adapter: a list of module names (matching a name or its last parts), a regex
    over the whole Hugging Face module name, or "all-linear". None: PEFT's default, q_proj and v_proj (rwkv:
    key, value, receptance and output)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (Kalajdzievski, 2023): scale by lora_alpha / √r."""
    modules_to_save: list[str] | None = None
    """Whole modules trained besides the adapters (e.g. ["lm_head"]), saved in full in the adapter."""
    bias: str = "none"
    """Which biases train: only "none" (PEFT's default) is supported."""
    trainable_token_indices: list[str | int] | dict[str, list[str | int]] | Literal["all"] | None = None
    """Tokens whose embedding rows train (the rest of the embedding stays frozen), e.g. a chat template's
    special tokens: ids (numbers) or token strings (quoted: "0" is the token 0, not id 0; resolved with the
    run's tokenizer), as a list or {embed_tokens: [...]}; all: every row.
    With tied embeddings the output layer uses the same rows (trainable_tokens.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"{_FIELD}.r={self.r!r}: the adapter's rank must be a whole number >= 1 (e.g. 8 or 16)")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or not (
                math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(f"{_FIELD}.lora_alpha={self.lora_alpha!r}: must be a positive number (often r or 2·r)")
        if not isinstance(self.lora_dropout, (int, float)) or not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"{_FIELD}.lora_dropout={self.lora_dropout!r}: must be in [0, 1), e.g. 0.05")
        if self.bias != "none":
            raise ConfigError(f"{_FIELD}.bias={self.bias!r}: only 'none' is supported (biases stay frozen); set "
                              "bias: none")
        targets = self.target_modules
        if not (targets is None or isinstance(targets, str) or
                isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t for t in targets)):
            raise ConfigError(f"{_FIELD}.target_modules={targets!r}: give a list of module names (e.g. [q_proj, "
                              "v_proj]), a regular expression, or all-linear")
        if isinstance(targets, tuple):
            self.target_modules = list(targets)
        if isinstance(targets, str) and targets != ALL_LINEAR:
            if len(targets) > _MAX_PATTERN:
                raise ConfigError(f"{_FIELD}.target_modules={targets[:80]!r}…: longer than {_MAX_PATTERN} "
                                  "characters; give a list of module names, all-linear, or a shorter regex")
            target_pattern(targets)
        saved = self.modules_to_save
        if saved is not None and not (isinstance(saved, (list, tuple)) and all(isinstance(m, str) for m in saved)):
            raise ConfigError(f"{_FIELD}.modules_to_save={saved!r}: give a list of module names, e.g. [lm_head]")
        check_token_indices(self.trainable_token_indices)

    @property
    def scaling(self) -> float:
        """s in y = W·x + s · B·A·x."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what checkpoints store: they load with weights_only=True)."""
        return asdict(self)


class LoraLinear(Linear):
    """A Linear with a low-rank adapter: the base `weight`/`bias` are the original module's own parameters
    (frozen), `lora_A` (r, in) and `lora_B` (out, r) are trained. The base weight may be an NF4 tensor
    (QLoRA, nf4.py): it is then dequantised inside each matmul."""

    def __init__(self, base: Linear, r: int, scaling: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        factory = {"device": base.weight.device, "dtype": adapter_dtype(base.weight)}
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **factory)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = scaling
        self.enabled = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The adapter's initialisation, as PEFT's: A Kaiming-uniform (a = √5, nn.Linear's), B zero. The base
        weight is never touched: it is what was loaded."""
        if not hasattr(self, "lora_A") or self.lora_A.weight.is_meta:
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """s · B·A·dropout(x), or None while the adapter is switched off. s scales the rank-r activations, the
        smallest tensor on the way, not the (…, out) result."""
        if not self.enabled:
            return None
        return self.lora_B(self.lora_A(self.lora_dropout(x)) * self.scaling)

    # forward is Linear's: it adds `delta` to the base projection, whichever way that is multiplied

    def merged_weight(self) -> torch.Tensor:
        """W + s · B·A in the base weight's dtype (computed in float32), dequantised when the base is NF4."""
        base = dense(self.weight).float()
        update = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (base + self.scaling * update).to(dense(self.weight).dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.lora_A.out_features}, scaling={self.scaling:g}"


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: NF4 weights dequantised (their `get_original_weight`)."""
    restore = getattr(weight, "get_original_weight", None)
    return restore() if restore is not None else weight


def adapter_dtype(weight: torch.Tensor) -> torch.dtype:
    """The adapter's dtype: the base weight's, or float32 under a quantised base (QLoRA trains fp32 adapters,
    computed in bf16 under bf16-mixed autocast)."""
    return torch.float32 if hasattr(weight, "get_original_weight") else weight.dtype


# -- which modules ---------------------------------------------------------------------------------------
def hf_module_name(name: str, model_type: str) -> str:
    """The Hugging Face name of our module `name` (as PEFT sees it inside the transformers model)."""
    from .hf_keys import hf_name

    return hf_name(f"{name}.weight", model_type).removesuffix(".weight")


@functools.lru_cache(maxsize=32)
def target_pattern(targets: str) -> Any:
    """`targets` compiled by RE2, whose matching takes time linear in the name for any pattern (Python's `re`
    backtracks: `((.+))+Z` on one module name runs for hours); ConfigError for what RE2 cannot compile."""
    import re2

    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(targets, options)
    except re2.error as err:
        why = err.args[0].decode(errors="replace") if err.args and isinstance(err.args[0], bytes) else err
        raise ConfigError(f"{_FIELD}.target_modules={targets[:80]!r} is not a regular expression RE2 accepts "
                          f"({why}; look-arounds and back-references are not supported); give a list of module "
                          "names, all-linear, or a regex without them") from None


def _matches(targets: list[str] | str, hf: str) -> bool:
    if isinstance(targets, str):
        return target_pattern(targets).fullmatch(hf) is not None
    return any(hf == t or hf.endswith("." + t) for t in targets)


def target_names(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Our names of the Linear modules `lora.target_modules` selects; ConfigError when it selects none, or the
    output layer under all-linear's meaning, or a MoE expert or router."""
    model_type = model.config.model_type
    targets = default_targets(model.config) if lora.target_modules is None else lora.target_modules
    chosen, refused = [], []
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head" and targets == ALL_LINEAR:
            continue
        if targets == ALL_LINEAR:
            if _NOT_ADAPTABLE.fullmatch(name) is None:
                chosen.append(name)
            continue
        if _matches(targets, hf_module_name(name, model_type)):
            (refused if _NOT_ADAPTABLE.fullmatch(name) else chosen).append(name)
    if refused:
        raise ConfigError(
            f"{_FIELD}.target_modules={targets!r} selects MoE experts or routers ({refused[0]}, …), which "
            "Hugging Face stores fused, so no PEFT adapter can hold them; target the attention projections "
            "(q_proj, k_proj, v_proj, o_proj) or use all-linear, which leaves the routed experts out")
    if not chosen:
        names = ("attention.key, attention.value, attention.receptance, attention.output, feed_forward.key, "
                 "feed_forward.value, feed_forward.receptance" if model.config.mixer == "rwkv" else
                 "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
        raise ConfigError(f"{_FIELD}.target_modules={targets!r} matches no linear layer of this "
                          f"{model_type} model; name some of {names}, or use all-linear")
    return chosen


def default_targets(config) -> list[str]:
    """PEFT's target_modules for a model type when none are given."""
    return list(RWKV_TARGETS if config.mixer == "rwkv" else DEFAULT_TARGETS)


def saved_module_names(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Our names of the modules `lora.modules_to_save` selects (PEFT's rule: the name or its last parts)."""
    names = []
    for wanted in lora.modules_to_save or []:
        found = [n for n, _ in model.named_modules() if n and (n == wanted or n.endswith("." + wanted))]
        if not found:
            raise ConfigError(f"{_FIELD}.modules_to_save: {wanted!r} names no module of this model; name e.g. "
                              "lm_head or embed_tokens")
        names.extend(found)
    if model.config.tie_word_embeddings and {"lm_head", "embed_tokens"} & set(names):
        raise ConfigError(f"{_FIELD}.modules_to_save={lora.modules_to_save!r}: this model ties lm_head to "
                          "embed_tokens, so training one trains both; leave them out, or untie the model first")
    return names


# -- adding, switching off, merging ---------------------------------------------------------------------
def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _check_rank(model: nn.Module, lora: LoraConfig, targets: list[str]) -> None:
    """ConfigError when r exceeds min(in, out) of a targeted layer: B·A has no higher rank there, and its
    matrices would only be larger (r = 10^11 would ask for terabytes)."""
    layers = [(name, model.get_submodule(name)) for name in targets]
    name, layer = min(layers, key=lambda item: min(item[1].in_features, item[1].out_features))
    bound = min(layer.in_features, layer.out_features)
    if lora.r > bound:
        raise ConfigError(f"{_FIELD}.r={lora.r}: larger than {name} ({layer.in_features} -> {layer.out_features}) "
                          f"allows, where an update B·A has rank at most {bound}; give r <= {bound} (e.g. 8 or 16)")


def apply_lora(model: nn.Module, lora: LoraConfig, tokenizer: Any = None) -> None:
    """Freeze every parameter of `model`, then give each targeted projection a trainable adapter, make the
    `modules_to_save` trainable (their original weights kept aside for `adapters_disabled`) and the rows of the
    `trainable_token_indices` (token strings resolved with `tokenizer`; the config kept holds their ids)."""
    if getattr(model, "lora_config", None) is not None:
        raise ConfigError(f"{_FIELD}: this model already has an adapter; merge it first (merge_lora) or load the "
                          "base without it")
    targets, saved = target_names(model, lora), saved_module_names(model, lora)
    _check_rank(model, lora, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in targets:
        _set_module(model, name, LoraLinear(model.get_submodule(name), lora.r, lora.scaling, lora.lora_dropout))
    originals = {}
    for name in saved:
        for pname, p in model.get_submodule(name).named_parameters():
            originals[f"{name}.{pname}"] = p.detach().clone()
            p.requires_grad_(True)
    if lora.trainable_token_indices is not None:
        if {"embed_tokens", "lm_head"} & {n.rsplit(".", 1)[-1] for n in saved}:
            raise ConfigError(f"{_FIELD}: modules_to_save={lora.modules_to_save!r} trains the embedding whole; "
                              "leave it out there, or leave trainable_token_indices out")
        ids = add_trainable_tokens(model, lora.trainable_token_indices, tokenizer)
        lora = dataclasses.replace(lora, trainable_token_indices=ids)
    model.lora_config = lora
    model.__dict__["lora_originals"] = originals  # outside the module tree: not in state_dict or parameters


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an adapter consists of, under our state-dict keys: each lora_A/lora_B weight, every parameter
    of the modules_to_save and the trainable tokens' rows."""
    saved = getattr(model, "lora_originals", {})
    return {k: v for k, v in model.state_dict().items()
            if ".lora_A." in k or ".lora_B." in k or k in saved or k == ROWS_KEY}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside: every adapter off and every module_to_save back at its original weights.

    The saved modules' tensors are swapped through `.data`, which leaves autograd's version counters alone, so
    a graph recorded before (the policy's forward of the same step) still back-propagates. Refused for
    modules_to_save of a sharded (FSDP2 or tensor-parallel) model, whose compute reads gathered copies that such a
    swap does not reach (the reference would silently keep the trained modules); used in the training thread only.
    """
    modules = [m for _, m in lora_modules(model)] + token_modules(model)
    originals = getattr(model, "lora_originals", {})
    params = dict(model.named_parameters()) if originals else {}  # only modules_to_save need looking up
    swapped = [(params[k], v) for k, v in originals.items()]
    if any(type(p).__name__ == "DTensor" for p, _ in swapped):
        raise ConfigError(f"{_FIELD}.modules_to_save={model.lora_config.modules_to_save!r} under a sharded "
                          "strategy (fsdp2): the base with the adapter off (DPO's and GRPO's reference) cannot "
                          "restore sharded modules. Fix: leave modules_to_save empty, or train with strategy: ddp")
    for m in modules:
        m.enabled = False
    for p, original in swapped:
        original.data, p.data = p.data, original.data.to(p.device, p.dtype)
    try:
        yield
    finally:
        for p, original in swapped:
            original.data, p.data = p.data, original.data
        for m in modules:
            m.enabled = True


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W ← W + s·B·A) and put plain Linears back: `model` is then an
    ordinary Transformer with the adapted weights (what PEFT's `merge_and_unload` gives), every weight trainable
    again as in a fresh one (an NF4 weight, which cannot train, excepted). In place; returns it."""
    for name, module in lora_modules(model):
        plain = Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        plain.weight = nn.Parameter(module.merged_weight().detach())
        plain.bias = module.bias
        _set_module(model, name, plain)
    remove_trainable_tokens(model, keep=True)
    for p in model.parameters():
        p.requires_grad_(not hasattr(p, "get_original_weight"))
    model.lora_config = None
    model.__dict__.pop("lora_originals", None)
    return model


def base_of(model: nn.Module) -> nn.Module:
    """A copy of `model` without its adapter: the base it was trained on (an NF4 base dequantised), its
    modules_to_save at their original weights. `model` itself is left as it is."""
    base = copy.deepcopy(model)
    params = dict(base.named_parameters())
    with torch.no_grad():
        for _, module in lora_modules(base):
            module.lora_B.weight.zero_()  # W + s·B·A with B = 0: the base weight, exactly
        for module in token_modules(base):
            module.token_rows.copy_(module.weight[module.token_indices])  # the base's own rows
        for key, original in getattr(base, "lora_originals", {}).items():
            params[key].copy_(original)
    return merge_lora(base)


def trainable_summary(model: nn.Module) -> str:
    """`trainable N of M parameters (p%)`, as the run prints it before step 1."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / max(total, 1):.4g}%)"
