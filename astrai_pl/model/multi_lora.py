"""Many LoRA adapters on one base model, chosen per row of a batch (as Punica and S-LoRA serve them).

Every projection that some loaded adapter targets becomes a `MultiLoraLinear`: the base weight, shared, and a
table slot → (A, B, s) of the adapters that target it. A forward step runs under `LoraSet.rows(names, lengths)`,
which says which adapter each token of the step's single (1, T) row belongs to; each projection then adds

    y[t] = W·x[t] + s_a · B_a·A_a·x[t]      for every token t of adapter a      (nothing for the base's tokens)

computed per adapter group: the tokens of adapter a gathered, multiplied by A_a (r_a, in) and B_a (out, r_a),
and added back at their rows (`index_add_`). No weight is ever merged, so requests for different adapters and
for the base share one batch. Ranks are not padded: each group runs at its own adapter's rank, so a rank-64
adapter costs its requests and no one else's; the cost of a step grows with the number of adapters present in
it, not with the number of requests. Adapters may target different modules: a projection only some adapters
target leaves the others' tokens alone.

An adapter is read by exactly the checks of `--adapter` (adapter_files.attach_adapter / read_adapter_tensors,
run against a copy of the model on the meta device, so nothing is allocated before the file is accepted).
Refused here, with the reason: `modules_to_save` (whole modules per adapter cannot share a batch) and adapters
on the output layer (only sampled rows reach it). Serve those merged (`astrai-pl convert --merge-lora`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .adapter_files import ADAPTER_CONFIG, attach_adapter, read_adapter_tensors
from .config import ConfigError
from .hf_config import CheckpointError
from .layers import Linear
from .lora import LoraConfig, lora_modules

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")

# The adapter groups of the step running in this thread: (slot, token rows or None for all of them).
_GROUPS: ContextVar[list[tuple[int, torch.Tensor | None]] | None] = ContextVar("astrai_pl_lora_rows", default=None)


class MultiLoraLinear(Linear):
    """A Linear holding the base's own weight and bias and the adapters of several slots (see the module doc)."""

    def __init__(self, base: Linear):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # slot → A (r, in), B (out, r), s

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        groups = _GROUPS.get()
        if not groups:
            return None
        flat = x.reshape(-1, self.in_features)  # (T, in)
        out = None
        for slot, rows in groups:
            if slot not in self.adapters:
                continue
            a, b, scaling = self.adapters[slot]
            part = flat if rows is None else flat.index_select(0, rows)  # (n, in)
            update = ((part @ a.t()) * scaling) @ b.t()  # (n, out)
            if rows is None:
                return update.view(*x.shape[:-1], self.out_features)
            if out is None:
                out = flat.new_zeros(flat.shape[0], self.out_features)
            out.index_add_(0, rows, update)
        return None if out is None else out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, adapters={sorted(self.adapters)}"


@dataclass
class LoadedAdapter:
    name: str
    slot: int  # never reused: a name loaded again gets a new slot (and so a new prefix-cache partition)
    path: str
    lora: LoraConfig
    modules: list[str]


class LoraSet:
    """The adapters served on `model`, by name; attached to it as `model.lora_set` (`LoraSet.of(model)`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, LoadedAdapter] = {}
        self._next_slot = 1  # slot 0 would be the base; slots only grow

    @classmethod
    def of(cls, model: nn.Module, create: bool = False) -> LoraSet | None:
        found = model.__dict__.get("lora_set")
        if found is None and create:
            found = model.__dict__["lora_set"] = cls(model)
        return found

    def check_name(self, name: str) -> None:
        """ConfigError for a name that is malformed or taken, or a model that cannot take adapters."""
        if not isinstance(name, str) or NAME.fullmatch(name) is None:
            raise ConfigError(f"adapter name {str(name)[:80]!r}: use 1-128 letters, digits and . _ : / - "
                              "(starting with a letter or digit)")
        if name in self.adapters:
            raise ConfigError(f"adapter name {name!r} is already loaded; unload it first or pick another name")
        if lora_modules(self.model) or getattr(self.model, "lora_config", None) is not None:
            raise ConfigError("this model carries a trained adapter of its own; merge it (astrai-pl convert "
                              "--merge-lora) before serving several adapters on it")

    def add(self, name: str, path: str | Path, checked: tuple | None = None) -> LoadedAdapter:
        """Install the PEFT adapter in `path` under `name` (`checked`: what `read_checked(model, path)` gave, or
        None to read it now); CheckpointError naming the file and the problem, ConfigError for a bad name."""
        self.check_name(name)
        lora, tensors = read_checked(self.model, path) if checked is None else checked
        loaded = LoadedAdapter(name, self._next_slot, str(path), lora, sorted({k.split(".lora_")[0] for k in tensors}))
        for module_name in loaded.modules:
            layer = self._multi(module_name)
            weight = layer.weight
            a = tensors[f"{module_name}.lora_A.weight"].to(weight.device, weight.dtype)
            b = tensors[f"{module_name}.lora_B.weight"].to(weight.device, weight.dtype)
            layer.adapters[loaded.slot] = (a, b, lora.scaling)
        self._next_slot += 1
        self.adapters[name] = loaded
        return loaded

    def remove(self, name: str) -> LoadedAdapter:
        loaded = self.adapters.pop(name)
        for module_name in loaded.modules:
            self.model.get_submodule(module_name).adapters.pop(loaded.slot, None)
        return loaded

    def _multi(self, module_name: str) -> MultiLoraLinear:
        layer = self.model.get_submodule(module_name)
        if isinstance(layer, MultiLoraLinear):
            return layer
        if type(layer) is not Linear or hasattr(layer.weight, "get_original_weight"):
            raise ConfigError(f"{module_name} is a {type(layer).__name__} (quantised or adapted), which per-row "
                              "adapters do not extend; serve a plain base model")
        multi = MultiLoraLinear(layer)
        parent, _, child = module_name.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, multi)
        return multi

    @contextlib.contextmanager
    def rows(self, names: list[str | None], lengths: list[int]) -> Iterator[None]:
        """Run a forward whose (1, T) row holds `lengths[i]` tokens of a request for adapter `names[i]` (None:
        the base), in that order."""
        by_slot: dict[int, list[int]] = {}
        start = 0
        for name, n in zip(names, lengths):
            if name is not None:
                by_slot.setdefault(self.adapters[name].slot, []).extend(range(start, start + n))
            start += n
        device = next(self.model.parameters()).device
        groups = [(slot, None if len(rows) == start else torch.tensor(rows, device=device))
                  for slot, rows in by_slot.items()]
        token = _GROUPS.set(groups)
        try:
            yield
        finally:
            _GROUPS.reset(token)


def read_checked(model: nn.Module, path: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The adapter in `path` checked as `Transformer.from_pretrained(base, adapter=path)` checks it, against a
    copy of `model` on the meta device: its config and its tensors under our module names."""
    from .transformer import Transformer

    with torch.device("meta"):
        shell = Transformer(model.config)
    file = attach_adapter(shell, path)
    lora: LoraConfig = shell.lora_config
    where = Path(path) / ADAPTER_CONFIG
    if lora.modules_to_save:
        raise CheckpointError(f"{where}: modules_to_save={lora.modules_to_save!r}: whole modules per adapter "
                              "cannot share a batch with other adapters. Fix: merge it (astrai-pl convert "
                              "--merge-lora) and serve the merged model")
    if lora.trainable_token_indices:
        raise CheckpointError(f"{where}: trainable_token_indices={lora.trainable_token_indices!r}: rows of the "
                              "embedding per adapter cannot share a batch with other adapters. Fix: merge it "
                              "(astrai-pl convert --merge-lora) and serve the merged model")
    if any(name == "lm_head" for name, _ in lora_modules(shell)):
        raise CheckpointError(f"{where}: target_modules adapt lm_head, which per-row adapters do not cover. Fix: "
                              "target the attention and MLP projections, or merge it and serve the merged model")
    return lora, read_adapter_tensors(shell, file)
