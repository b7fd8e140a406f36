"""How the Transformer is laid out for training, applied in `Objective.configure_model` in this order:

0. FP8 training (`fp8: tensorwise | rowwise`, torchao's float8 linear layers), on a GPU that has FP8 matmuls;
1. tensor parallelism (DTensor) over the mesh's `tensor_parallel` dimension, when it has more than one device;
2. activation checkpointing per block: `none`, `full` (recompute the whole block) or `selective`
   (keep the matmul and attention outputs, recompute the pointwise ops between them);
3. `torch.compile` per block;
4. FSDP2: `fully_shard` on every block, then on the root, over the `data_parallel` dimension.

Steps 1 and 4 need a device mesh, which `FSDP2Strategy` (astrai_pl/strategy.py, `strategy: fsdp2`) builds;
steps 2 and 3 work under any strategy. Every step keeps parameter names, so checkpoints and Hugging Face
exports do not depend on the layout they were trained with. `gather_full_weights` undoes steps 1 and 4 into a
plain copy of the model (`weightless_copy`, made before them) for a while: GRPO's rollouts decode on it, and
`release_weights` empties it again.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from .model import ConfigError, Transformer
from .model.gemma import GemmaRMSNorm
from .model.hf_shards import restore_rotary_buffers
from .model.layers import RMSNorm
from .strategy import DTYPES, ParallelConfigError  # importing it registers `strategy: fsdp2`

ActivationCheckpointing = Literal["none", "full", "selective"]
AC_MODES = ("none", "full", "selective")


# -- activation checkpointing -----------------------------------------------------------------------------
def _aten_ops(*names: str) -> frozenset:
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


# Outputs kept by `selective`: the matmuls and fused attention kernels (costly to redo); the pointwise ops
# between them (norms, RoPE, SiLU, products, residual adds) are recomputed in the backward pass.
SAVED_OPS = _aten_ops(
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(mode: str):
    if mode == "selective":
        return functools.partial(create_selective_checkpoint_contexts, selective_policy)
    return noop_context_fn


@functools.cache
def _checkpointed_class(cls: type[nn.Module], mode: str) -> type[nn.Module]:
    """A subclass of `cls` whose forward runs under torch.utils.checkpoint (non-reentrant)."""
    context_fn = _context_fn(mode)

    def forward(self, *args, **kwargs):
        inner = super(checkpointed, self).forward
        if not torch.is_grad_enabled():  # evaluation and generation: nothing to save
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    checkpointed = type(
        f"{cls.__name__}", (cls,), {"forward": forward, "checkpointing": mode, "__module__": cls.__module__}
    )
    return checkpointed


def check_activation_checkpointing(mode: str) -> None:
    if mode not in AC_MODES:
        raise ParallelConfigError(f"activation_checkpointing={mode!r}: use one of {', '.join(AC_MODES)}")


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Checkpoint every block in place. The block's class is swapped for a checkpointing subclass, so
    parameter names and deep copies stay as they were."""
    check_activation_checkpointing(mode)
    for block in model.layers:
        current = getattr(block, "checkpointing", "none")
        if current == mode:
            continue
        if current != "none":
            raise ParallelConfigError(
                f"activation_checkpointing={mode!r}: the blocks already use {current!r}; "
                "build a fresh model to change the mode"
            )
        if mode != "none":
            block.__class__ = _checkpointed_class(type(block), mode)


def compile_blocks(model: Transformer, **options: Any) -> None:
    """torch.compile each block in place (`nn.Module.compile`: names and state dict unchanged)."""
    for block in model.layers:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(**options)


# -- tensor parallelism -----------------------------------------------------------------------------------
# The projections of a block split column-wise (their outputs) and row-wise (their inputs), by mixer.
# RWKV-4: the wkv recurrence runs per channel, so each rank runs it on its own channels of the time mix's k and
# v, with time_decay and time_first sharded alike (`_shard_rwkv_vectors`); the channel mix's receptance gates
# the all-reduced value output, so it stays whole (replicated).
TP_LAYOUT = {
    "attention": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                   "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj")),
    "rwkv": (("attention.key", "attention.value", "attention.receptance", "feed_forward.key"),
             ("attention.output", "feed_forward.value")),
}


def _block_plan(mixer: str = "attention") -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    columns, rows = TP_LAYOUT[mixer]
    return {**{name: ColwiseParallel() for name in columns}, **{name: RowwiseParallel() for name in rows}}


def _shard_rwkv_vectors(block: nn.Module, mesh) -> None:
    """time_decay and time_first as DTensors sharded on their channels like the key/value outputs, the
    token-shift μ replicated (they mix the whole input); rwkv.local gives the forward each rank's part."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for mix in (block.attention, block.feed_forward):
        for name, param in list(mix.named_parameters(recurse=False)):
            layout = [Shard(0)] if name in ("time_decay", "time_first") else [Replicate()]
            sharded = nn.Parameter(distribute_tensor(param.data, mesh, layout), param.requires_grad)
            mix.register_parameter(name, sharded)


def check_tensor_parallel(cfg, tp: int) -> None:
    if cfg.mixer == "rwkv":
        for name in ("hidden_size", "intermediate_size"):
            if getattr(cfg, name) % tp:
                raise ParallelConfigError(
                    f"tensor_parallel_size={tp} does not divide ModelConfig.{name}={getattr(cfg, name)}; "
                    "pick a size that divides the RWKV width and the channel mix width")
        return
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(cfg, name) % tp:
            raise ParallelConfigError(
                f"tensor_parallel_size={tp} does not divide ModelConfig.{name}="
                f"{getattr(cfg, name)}; pick a size that divides the heads and the MLP width"
            )
    if cfg.num_experts:
        raise ParallelConfigError(
            f"tensor_parallel_size={tp}: MoE models (num_experts={cfg.num_experts}) have no "
            "tensor-parallel plan here; use tensor_parallel_size=1 (FSDP2 alone)"
        )
    if cfg.wide_qk_norm:
        raise ParallelConfigError(
            f"tensor_parallel_size={tp}: {cfg.model_type}'s q/k norms span every head, which column-parallel q/k "
            "projections split over processes; use tensor_parallel_size=1 (FSDP2 alone)"
        )


def _replicated_input(layout):
    """input_fn for distribute_module: wrap plain tensors as DTensors with the given placement."""
    from torch.distributed.tensor import DTensor

    def wrap(module, inputs, mesh):
        return tuple(
            DTensor.from_local(t, mesh, layout, run_check=False)
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
            else t
            for t in inputs
        )

    return wrap


def _local_output(module, output, mesh):
    return output.to_local() if hasattr(output, "to_local") else output


def apply_tensor_parallel(model: Transformer, mesh) -> None:
    """Megatron-style plan: q/k/v and gate/up column-wise, o_proj and down_proj row-wise (one all-reduce
    after attention and one after the MLP; RWKV: `TP_LAYOUT`, one after each mix). Every other parameter
    becomes a DTensor replicated over the
    mesh, so all parameters share one mesh and gradient clipping sees one norm."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    if getattr(model, "lora_config", None) is not None:
        raise ConfigError(
            f"model.init_args.lora with FSDP2Strategy.tensor_parallel_size={tp}: tensor parallelism has no plan "
            "for LoRA adapters (their A and B matrices would need their own layouts); use tensor_parallel_size=1, "
            "under which FSDP2 shards the frozen base and the adapter over every process, or drop lora"
        )
    check_tensor_parallel(model.config, tp)
    tied = model.lm_head.weight is model.embed_tokens.weight
    for block in model.layers:
        parallelize_module(block, mesh, _block_plan(model.config.mixer))
        if model.config.mixer == "rwkv":
            _shard_rwkv_vectors(block, mesh)
            continue
        block.self_attn.n_heads //= tp
        block.self_attn.n_kv_heads //= tp
    for name, module in model.named_modules():
        head_norm = name.endswith(("q_norm", "k_norm"))  # acts on this rank's heads: (B, T, H/tp, D)
        whole = name == "lm_head" or name.endswith("feed_forward.receptance")  # RWKV's gate: replicated
        if isinstance(module, (RMSNorm, GemmaRMSNorm, nn.LayerNorm, nn.Embedding)) or whole:
            layout = [Shard(2)] if head_norm else [Replicate()]
            distribute_module(module, mesh, input_fn=_replicated_input(layout), output_fn=_local_output)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight


# -- FP8 training -------------------------------------------------------------------------------------------
FP8_RECIPES = ("tensorwise", "rowwise")


class FP8UnavailableError(ParallelConfigError):
    """FP8 training was asked for on a device without FP8 matmuls (CPU, or a CUDA GPU below capability 8.9)."""


def check_fp8_recipe(recipe: str | None) -> None:
    """ConfigError unless `recipe` is None or one of FP8_RECIPES."""
    if recipe is not None and recipe not in FP8_RECIPES:
        raise ConfigError(f"fp8={recipe!r}: unknown FP8 recipe; use tensorwise (one scale per tensor, the faster), "
                          "rowwise (one scale per row, the more accurate), or null for no FP8")


def check_fp8_device(device: torch.device) -> None:
    """FP8UnavailableError unless `device` is a CUDA GPU of compute capability 8.9 or higher (Ada, Hopper and
    later), whose tensor cores multiply float8 matrices (`torch._scaled_mm`)."""
    fix = "train on a GPU of compute capability 8.9 or higher (L4, L40, H100, H200, B200), or set fp8: null"
    if device.type != "cuda":
        raise FP8UnavailableError(f"fp8: the model trains on {device.type}, which has no FP8 tensor cores (float8 "
                                  f"matmuls there only emulate a GPU's arithmetic, slower than bf16); {fix}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise FP8UnavailableError(f"fp8: {torch.cuda.get_device_name(device)} has compute capability "
                                  f"{capability[0]}.{capability[1]}, below the 8.9 that FP8 matmuls need; {fix}")


def fp8_eligible(module: nn.Module, name: str) -> bool:
    """Whether a linear layer trains in FP8: every one but the output layer (its logits feed the loss, where
    float8's rounding shows most), and only where both dimensions are multiples of 16 (`torch._scaled_mm`)."""
    if name.rsplit(".", 1)[-1] == "lm_head":
        return False
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model: nn.Module, recipe: str, *, fsdp: bool = False) -> list[str]:
    """Swap the linear layers that `fp8_eligible` picks for torchao's Float8Linear (their weights stay as they
    are; inputs, weights and output gradients are cast to float8 inside each matmul, scaled per tensor or per
    row by `recipe`), in place, and return their names. `fsdp` with "tensorwise": FSDP2 all-gathers the weights
    in float8 (half the bytes of bf16). Before compile and FSDP2, as `configure_model` orders it; the device is
    not checked here (`check_fp8_device`). A second call converts nothing more."""
    check_fp8_recipe(recipe)
    if getattr(model, "lora_config", None) is not None:
        raise ConfigError(f"fp8={recipe!r} with a LoRA adapter: FP8 trains the full linear weights; drop lora")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = (Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp) if recipe == "tensorwise"
              else Float8LinearConfig.from_recipe_name(recipe))
    def pick(m: nn.Module, name: str) -> bool:  # not yet converted (configure_model may run again), and eligible
        return type(m) is not Float8Linear and fp8_eligible(m, name)

    chosen = [name for name, m in model.named_modules() if pick(m, name)]
    convert_to_float8_training(model, config=config, module_filter_fn=pick)
    return chosen


def fp8_scales_after_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Under FSDP2's float8 all-gather (tensorwise), compute every weight's float8 scale once per optimizer step,
    in one all-reduce, instead of one per weight at its all-gather; True when the hook was registered."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    if not any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules()):
        return False
    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return True


# -- FSDP2 -----------------------------------------------------------------------------------------------
def apply_fsdp2(
    model: Transformer,
    mesh,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """fully_shard every block, then the root (embeddings, final norm, lm_head).

    The root keeps its parameters gathered from its forward to its backward (as FSDP2 does for the root
    when left to choose): they are needed again at once, and the objectives read the lm_head's weight
    after the root's forward method has returned. `hidden_states` is registered as a forward method of
    the root, since the objectives call it instead of `forward` and it must gather those parameters too.
    """
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if isinstance(model, FSDPModule):
        return
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[param_dtype] if param_dtype else None,
        reduce_dtype=DTYPES[reduce_dtype] if reduce_dtype else None,
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    register_fsdp_forward_method(model, "hidden_states")


def configure_model(
    model: Transformer, strategy: Any, activation_checkpointing: str = "none", compile: bool = False,
    fp8: str | None = None,
) -> None:
    """Apply the layout above. Idempotent: Lightning may call it again for validate/test after fit."""
    mesh = strategy.device_mesh if isinstance(strategy, ModelParallelStrategy) else None
    if fp8 is not None:
        check_fp8_device(strategy.root_device)
        if mesh is not None and mesh["tensor_parallel"].size() > 1:
            raise ParallelConfigError(
                f"fp8={fp8!r} with FSDP2Strategy.tensor_parallel_size={mesh['tensor_parallel'].size()}: FP8 has no "
                "tensor-parallel plan here; use tensor_parallel_size=1 (FSDP2 alone), or drop fp8")
        convert_to_fp8(model, fp8, fsdp=mesh is not None)
    if mesh is not None and mesh["tensor_parallel"].size() > 1 and not _has_dtensors(model):
        apply_tensor_parallel(model, mesh["tensor_parallel"])
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        compile_blocks(model)
    if mesh is not None:
        options = getattr(strategy, "fsdp_options", {})
        apply_fsdp2(model, mesh["data_parallel"], **options)


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor (tensor parallel, or an FSDP2 shard), without importing DTensor."""
    return type(tensor).__name__ == "DTensor"


def _has_dtensors(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


# -- full weights for inference ------------------------------------------------------------------------------
def weightless_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` in eval mode whose parameters are empty and frozen (ties kept), made without
    copying a single weight: the shell that `gather_full_weights` fills. Of a model on the meta device (not yet
    materialised), the shell's parameters are empty on the CPU and its RoPE tables are computed there."""
    empty = {id(p): nn.Parameter(torch.empty(0, dtype=p.dtype, device="cpu" if p.is_meta else p.device),
                                 requires_grad=False) for p in model.parameters()}
    shell = copy.deepcopy(model, empty).eval()
    if any(b.is_meta for b in shell.buffers()):
        restore_rotary_buffers(shell)
    return shell


def gather_full_weights(source: nn.Module, target: nn.Module) -> None:
    """Load `source`'s weights into `target`, a plain (unsharded) copy of the same model, one parameter at a
    time: each DTensor (an FSDP2 shard, a tensor-parallel part) is all-gathered, so every rank must call this
    at the same point (the collectives follow `named_parameters` order). Parameters keep their identity, so
    whatever holds `target` (an inference engine) sees the new weights; its buffers move to their device."""
    params = dict(target.named_parameters())
    names = [name for name, _ in source.named_parameters()]
    if sorted(names) != sorted(params):
        missing = sorted(set(names) ^ set(params))
        raise ValueError(f"gather_full_weights: the models' parameters differ (e.g. {missing[0]}); target must "
                         "be a copy of source made before it was laid out")
    device = None
    with torch.no_grad():
        for name, param in source.named_parameters():
            full = param.full_tensor() if is_dtensor(param) else param.detach()
            params[name].data = full
            device = full.device
    if device is not None:
        target.to(device)  # the buffers (rotary tables), which stay wherever the copy was made


def release_weights(model: nn.Module) -> None:
    """Free every parameter's storage (each becomes an empty tensor of its dtype and device) and keep the
    modules, so `gather_full_weights` can fill them again."""
    for param in model.parameters():
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
