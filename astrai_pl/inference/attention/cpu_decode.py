"""A decode step of a Llama-shaped model on CPU: one kernel call for the whole stack instead of the module path.

A decode step's forward on CPU spends most of its time in the fused kernels (`panel_matmul`, the paged decode
attention, RMSNorm, RoPE, SwiGLU), but between them sit a few dozen PyTorch ops, the modules' Python and five
OpenMP regions per layer that wake threads gone to sleep (OMP_WAIT_POLICY=PASSIVE). `cpu_ops.decode_layers`
runs every block through the same kernels in one region, its threads meeting at the kernels' own barrier
(a short spin, then a sleep), so a step is one call plus the embedding, the rotary angles and the final norm.
Its rows come out bit for bit as the module path's (tests/inference/test_cpu_decode.py compares every logit):
the same kernels in the same order on the same weight copies (`InputMajorWeights`), only the glue is gone.

It takes a step when every request in it decodes one token (a step with a prefill chunk runs the modules),
there are at most `PANEL_MAX_ROWS` of them (above that the module path multiplies by the weights as stored),
the decode attention reads the pool through the CPU kernel, and the model is a plain Llama block stack:
RMSNorm, q/k/v/o without bias or q/k norm, full attention at the default scale, no soft-cap, a SwiGLU MLP,
plain `Linear` projections on plain float32 weights (no adapter, no NF4) and RoPE over whole heads by position alone,
with no forward hook on a block's modules (the one-call layer calls none of them).
Anything else (Gemma, Qwen2's biases, Qwen3's q/k norm, sliding windows, MoE, RWKV, LoRA, longrope, Phi's
partial rotary) runs the modules, as before.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as nn_module

from ...model.attention import Attention
from ...model.layers import InputMajorWeights, Linear, RMSNorm, SwiGLU
from ...model.transformer import Block
from ...ops import cpu as cpu_ops
from .view import StepView

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # weights the panels copy (not NF4, not DTensor)


def unsupported(model) -> str | None:
    """Why `model` cannot take the one-call decode layer (None: it can)."""
    cfg = model.config
    if cfg.mixer == "rwkv" or cfg.is_gemma or cfg.post_norm:
        return "not a plain Llama block stack"
    rotary = getattr(model, "rotary", None)
    if rotary is None or rotary.per_sequence or model.rotary_local is not None:
        return "its rotary angles depend on more than the position"
    if cfg.rotary_dim != cfg.head_size:
        return "a partial rotary embedding"
    if cfg.head_size % 8:
        return "a head width the decode attention kernel does not take (a multiple of 8)"
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        if type(block) is not Block or type(attn) is not Attention or type(mlp) is not SwiGLU:
            return "a block that is not attention + SwiGLU"
        if type(block.input_layernorm) is not RMSNorm or type(block.post_attention_layernorm) is not RMSNorm:
            return "a norm that is not RMSNorm"
        if block.input_layernorm.eps != block.post_attention_layernorm.eps:
            return "two norms of one block with different eps"
        if attn.q_norm is not None or attn.window is not None or attn.scale is not None or attn.softcap is not None:
            return "q/k norms, a sliding window, a custom scale or soft-capping"
    return None


def _structure(block) -> tuple:
    """The modules a block's one-call layer stands for, as they are now: the block, its children and theirs (the
    norms, attention and MLP, and the projections inside them). Replacing any of them (an adapter) changes it."""
    return (block, tuple(block._modules.values()), tuple(block.self_attn._modules.values()),
            tuple(block.mlp._modules.values()))


def _plain(linear) -> bool:
    """A Linear the panels stand for: no adapter (a subclass), no bias (a parameter or not), a plain weight."""
    return type(linear) is Linear and linear.bias is None and type(linear.weight) in _PLAIN


class CpuDecode:
    """The decode steps of one model, one kernel call each (see the module docstring)."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        hidden, hq, hkv, D, inter = self.shape = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                  cfg.head_size, cfg.intermediate_size)
        # the packed copies each layer's q/k/v, o, gate/up and down must have
        self.panel_shapes = (cpu_ops.panels_shape((hq + 2 * hkv) * D, hidden), cpu_ops.panels_shape(hidden, hq * D),
                             cpu_ops.panels_shape(2 * inter, hidden), cpu_ops.panels_shape(hidden, inter))
        self.work: torch.Tensor | None = None
        self._structure: list[tuple] | None = None  # what _blocks' lists were made from
        self._unsupported: str | None = None  # why the blocks as they are now cannot take this path
        self._linears: list[tuple] = []
        self._modules: list[torch.nn.Module] = []

    @classmethod
    def for_model(cls, model) -> CpuDecode | None:
        """The one-call decode steps of `model`, or None where its blocks are not plain Llama ones."""
        return cls(model) if unsupported(model) is None else None

    def _panels(self, weights: InputMajorWeights) -> list[tuple] | None:
        """Each layer's (norm weights, eps, packed q/k/v, o, gate/up, down), or None where a layer must run its
        modules: an adapter (a Linear subclass), a bias, a weight that is not a plain float32 tensor (NF4, a
        distributed one), a forward hook, or copies not packed in panels of the expected shapes.

        Asked every step, so a hook or an adapter added between two steps is seen at the next one. What it
        reads of the module tree is kept from step to step (`_blocks`) and made again when a block's structure
        changes: walking every module of every block took 5 ms a step at the SmolLM2-135M shape."""
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return None
        blocks = self._blocks()
        if self._unsupported is not None or any(m._forward_hooks or m._forward_pre_hooks for m in self._modules):
            return None
        out = []
        for block, linears in blocks:
            if not all(_plain(lin) for lin in linears):
                return None
            attn_q, attn_k, attn_v, attn_o, gate, up, down = (lin.weight for lin in linears)
            panels = (weights.get(attn_q, attn_k, attn_v), weights.get(attn_o), weights.get(gate, up),
                      weights.get(down))
            if any(p is None or tuple(p.shape) != shape for p, shape in zip(panels, self.panel_shapes)):
                return None
            norms = (block.input_layernorm.weight, block.post_attention_layernorm.weight)
            out.append((norms, block.input_layernorm.eps, panels))
        return out

    def _blocks(self) -> list[tuple]:
        """Each block with its seven projections, and every module of every block in `_modules` (for the hook
        check), made again whenever a block's structure is not the one they were made from; then also whether
        the blocks are still plain Llama ones (`_unsupported`: a norm or MLP of another kind swapped in)."""
        structure = [_structure(block) for block in self.model.layers]
        if structure != self._structure:
            self._structure = structure
            self._unsupported = unsupported(self.model)
            self._linears = [(block, (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj,
                                      block.self_attn.o_proj, block.mlp.gate_proj, block.mlp.up_proj,
                                      block.mlp.down_proj)) for block in self.model.layers]
            self._modules = [m for block in self.model.layers for m in block.modules()]
        return self._linears

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, view: StepView,
                      weights: InputMajorWeights | None) -> torch.Tensor | None:
        """The final normed hidden states (1, n, hidden) of a decode step, or None when this step is not one
        this path takes (nothing has been computed or written then)."""
        n = input_ids.shape[1]
        if (weights is None or torch.is_grad_enabled() or view.num_decode != n or not 0 < n <= cpu_ops.PANEL_MAX_ROWS
                or not cpu_ops.paged_decode_attention_usable(view.storage.k[0, :1], view.storage.k[0],
                                                             view.storage.v[0])):
            return None
        layers = self._panels(weights)
        if layers is None:
            return None
        model = self.model
        x = model.embed_tokens(input_ids)  # (1, n, hidden), a fresh tensor: the layers write it in place
        x2 = x.view(n, -1)
        if not cpu_ops.panel_matmul_usable(x) or any(eps != layers[0][1] for _, eps, _ in layers) or not all(
                cpu_ops.rms_norm_usable(x2, w) and w.is_contiguous() for norms, _, _ in layers for w in norms):
            return None
        cos, sin = (t.reshape(n, -1).contiguous() for t in model.rotary(position_ids, x.dtype))
        hidden, hq, hkv, D, inter = self.shape
        if cos.shape[1] != D or tuple(view.storage.k.shape[2:]) != (hkv, D):
            return None
        size = cpu_ops.decode_layer_work(n, hidden, hq, hkv, D, inter)
        if self.work is None or self.work.numel() < size:
            self.work = x.new_empty(size)
        kv_lens = view.kv_lens
        lens, longest = torch.tensor(kv_lens, dtype=torch.int32), max(kv_lens)
        k, v = view.storage.k, view.storage.v
        pointers = cpu_ops.decode_layer_pointers([(*norms, *panels, k[i], v[i])
                                                  for i, (norms, _, panels) in enumerate(layers)])
        cpu_ops.decode_layers(x2, pointers, layers[0][1], (hq, hkv), D, inter, cos, sin, view.out_slots,
                              view.req_to_token, view.rows.contiguous(), lens, longest, self.work)
        return model.norm(x)
