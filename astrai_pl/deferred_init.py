"""Models bigger than one host's memory: built on the meta device (shapes, no storage), laid out by
`configure_model` (FSDP2 gives each process its shard of every parameter), then filled where they lie. Each process
allocates only its shards, and fills them either from a Hugging Face directory (`load_pretrained_into`: it reads
only its regions of each tensor) or by drawing the initial weights.

The draw. A fresh model built whole draws every weight from the global generator in module order, constructors
first; a process holding shards cannot replay that stream without drawing the whole model. So each parameter is
drawn here whole, on the CPU, by the rules of `Transformer.reset_parameters` (a module they do not cover: its
own `reset_parameters`) from a generator seeded with (seed + the module's index), one module at a time, and each
process keeps its region. The weights depend on the seed alone: the same for any
number of processes, on any device, and for a one-process meta build. They follow the same distributions as a
model built whole, but are not bit-equal to one built whole with the same seed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from .model import ConfigError, Transformer
from .model.gemma import GemmaRMSNorm
from .model.hf_shards import load_pretrained_into, local_part, local_region, restore_rotary_buffers
from .model.layers import RMSNorm


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device (built, not yet materialised)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def check_meta_build(model: Transformer, lora, quantize) -> None:
    """ConfigError for what a meta-device build does not cover, naming the way out."""
    fix = "set meta_init: false (and build the objective outside trainer.init_module(empty_init=True))"
    if model.config.mixer == "rwkv":
        raise ConfigError(f"a meta-device build of an RWKV model: its time parameters follow a schedule over depth "
                          f"that is not drawn per shard; {fix}")
    if lora is not None or quantize is not None:
        raise ConfigError(f"a meta-device build with {'quantize' if quantize else 'lora'}: the adapters and NF4 "
                          f"weights are made from a base in memory; {fix}")


class _OneModule:
    """What `Transformer.reset_parameters` reads of a model, narrowed to one of its modules."""

    def __init__(self, config, name: str, module: nn.Module):
        self.config, self._named = config, (name, module)

    def named_modules(self):
        yield self._named


def _draw(name: str, module: nn.Module, config, seed: int) -> None:
    """Fill `module`'s own parameters (materialised on the CPU) by the Transformer's rules, on a generator seeded
    with `seed`; a module those rules do not cover keeps its own `reset_parameters`, as its constructor ran it."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.default_generator.manual_seed(seed)  # the CPU's alone: the draw is the same on any device
        if isinstance(module, (nn.Linear, nn.Embedding, RMSNorm, GemmaRMSNorm)):
            Transformer.reset_parameters(_OneModule(config, name, module))
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        else:
            raise ConfigError(f"{name} ({type(module).__name__}) has parameters but no initialisation to draw them "
                              "by; set meta_init: false")


def initialize_shards(model: nn.Module, skeleton: Transformer, seed: int) -> None:
    """Draw `skeleton`'s parameters one module at a time (see the module docstring) and copy this process's region
    of each into `model`'s parameter of the same name (plain or DTensor, already materialised)."""
    params = dict(model.named_parameters())
    for index, (name, module) in enumerate(skeleton.named_modules()):
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        if not own:
            continue
        module.to_empty(device="cpu", recurse=False)
        _draw(name, module, skeleton.config, (seed + index) % 2**64)
        with torch.no_grad():
            for short, _ in own:
                target = params.get(f"{name}.{short}" if name else short)
                if target is not None:  # None: a tied weight, drawn with the module that names it first
                    local_part(target).copy_(getattr(module, short)[local_region(target)])
        module.to_empty(device="meta", recurse=False)  # its memory back before the next module


def materialize(model: nn.Module, skeleton: Transformer, device: torch.device, weights: Path | None,
                seed: int) -> None:
    """Give `model` (laid out on the meta device) storage on `device` for what this process holds, then fill it:
    from the Hugging Face directory `weights`, or drawn from `seed`. `skeleton`: a meta copy of the model made
    before the layout (the whole shapes, the modules' own initialisation)."""
    model.to_empty(device=device)
    if model.config.tie_word_embeddings and model.lm_head.weight is not model.embed_tokens.weight:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty gives each module its own new tensor
    if weights is not None:
        load_pretrained_into(model, weights)
    else:
        initialize_shards(model, skeleton, seed)
    restore_rotary_buffers(model)
    assert not on_meta(model), "a tensor was left on the meta device"


def meta_skeleton(model: nn.Module) -> Transformer | None:
    """A copy of `model` when it is on the meta device (free: meta tensors hold no storage), else None."""
    return copy.deepcopy(model) if on_meta(model) else None
