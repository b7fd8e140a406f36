"""The shared pre-norm decoder: embeddings → blocks (attention + SwiGLU or MoE) → RMSNorm → lm_head.

With `model_type="rwkv"` the blocks are RWKV-4 time mix + channel mix and the norms LayerNorms (rwkv.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .attention import Attention, AttentionMask, KVCacheView, document_ids_from_positions
from .config import ModelConfig
from .gemma import GemmaBlock, GemmaRMSNorm, dense_mlp, norm_for, output_layer
from .layers import RMSNorm, RotaryEmbedding, keep_rows
from .moe import MoE
from .olmo2 import PostNormBlock
from .rwkv import RwkvBlock, final_norm, reset_rwkv_parameters, run_blocks


@dataclass
class TransformerOutput:
    """What a forward returns: the logits and, for MoE models, the mean load-balancing loss over MoE layers."""

    logits: torch.Tensor  # (B, T, V)
    aux_loss: torch.Tensor | None = None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else dense_mlp(cfg)

    def forward(self, x, rope, mask: AttentionMask, cache: KVCacheView | None = None, queries=None):
        x = keep_rows(x, queries) + self.self_attn(self.input_layernorm(x), rope, mask, cache, queries)
        out = self.mlp(self.post_attention_layernorm(x))
        if isinstance(out, tuple):  # MoE: (output, aux loss)
            return x + out[0], out[1]
        return x + out, None


def gemma_block(cfg: ModelConfig, layer_idx: int) -> GemmaBlock:
    return GemmaBlock(cfg, Attention(cfg, layer_idx))


class Transformer(nn.Module):
    """Decoder-only transformer shared by every objective and by the inference engine.

    `model(input_ids, position_ids=None, document_ids=None)` returns a TransformerOutput. Packed rows:
    pass `document_ids` (B, T), or position ids that restart at 0 for each document; attention is then
    block-causal, so no token sees another document.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        recurrent = config.mixer == "rwkv"
        block = RwkvBlock if recurrent else gemma_block if config.is_gemma else Block
        block = PostNormBlock if config.post_norm else block
        self.layers = nn.ModuleList(block(config, i) for i in range(config.num_hidden_layers))
        self.norm = final_norm(config) if recurrent else norm_for(config, config.hidden_size)
        self.lm_head = output_layer(config)
        self.rotary = None if recurrent else RotaryEmbedding(config)  # RWKV has no positions
        self.rotary_local = None  # Gemma 3: the sliding layers' own RoPE base, unscaled
        if config.rope_local_base_freq is not None:
            local = dataclasses.replace(config, rope_theta=config.rope_local_base_freq, rope_scaling=None)
            self.rotary_local = RotaryEmbedding(local)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.lora_config = None  # a LoraConfig once adapters are added (lora.py)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) for matrices; residual projections scaled by 1/sqrt(2·layers) (GPT-2); norms at one."""
        std = self.config.initializer_range
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, module in self.named_modules():
            last = name.rsplit(".", 1)[-1]
            if last in ("lora_A", "lora_B"):
                continue  # an adapter keeps its own initialisation (B zero): LoraLinear.reset_parameters
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, residual_std if last in ("o_proj", "down_proj") else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, GemmaRMSNorm):  # (1 + w): zero is the identity scale
                nn.init.zeros_(module.weight)
        if self.config.mixer == "rwkv":
            reset_rwkv_parameters(self.layers, residual_std)

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # (B, T)
        position_ids: torch.Tensor | None = None,  # (B, T)
        document_ids: torch.Tensor | None = None,  # (B, T)
        cache: KVCacheView | None = None,
        sequence_lengths: torch.Tensor | None = None,  # (B, T)
        branch_ids: torch.Tensor | None = None,  # (B, T)
        output_rows: torch.Tensor | None = None,  # (B, k)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final normed hidden states (B, T, hidden) and the MoE auxiliary loss (None for dense models).
        `sequence_lengths`: the whole length of each token's sequence, where longrope needs more than this forward
        shows (the engine's prompt chunks); by default the largest position of its row or document, plus one.
        `branch_ids`: a row laid out as a prefix tree (0: the shared trunk, b > 0: branch b; see
        `AttentionMask.build`), with `position_ids` giving each token its position in its own sequence.
        `output_rows`: only the states at these rows of each batch row, (B, k, hidden), are wanted (a reward
        model's last tokens): the last layer then computes its queries, output projection and MLP for them
        alone (an attention model without a cache; otherwise the rows are picked from the full result), so an
        MoE last layer's share of the auxiliary loss covers those rows only."""
        return self._hidden_states(input_ids, position_ids, document_ids, cache, sequence_lengths, branch_ids,
                                   output_rows)

    def _hidden_states(self, input_ids, position_ids, document_ids, cache, sequence_lengths=None, branch_ids=None,
                       output_rows=None):
        # The body of both `hidden_states` and `forward`: FSDP2 wraps each of the two public methods with
        # its gather/reshard hooks (parallel.py), so neither may call the other.
        if branch_ids is not None and (cache is not None or position_ids is None or self.config.mixer == "rwkv"):
            raise ValueError("branch_ids lay out a prefix tree for attention: they need position_ids, no cache "
                             "and an attention model")
        if self.config.mixer == "rwkv":  # no positions or mask; each document restarts the recurrent state
            x = run_blocks(self.layers, self.embed_tokens(input_ids), position_ids, document_ids, cache)
            return self.norm(keep_rows(x, output_rows)), None
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        elif document_ids is None and cache is None and branch_ids is None:
            document_ids = document_ids_from_positions(position_ids)
        x = self.embed_tokens(input_ids)
        if self.config.is_gemma:  # sqrt(hidden) rounded to the activations' dtype, as transformers does
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        rope = self.rotary(position_ids, x.dtype, document_ids, sequence_lengths)
        local = rope if self.rotary_local is None else self.rotary_local(position_ids, x.dtype)
        compute = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        windows = {self.config.layer_window(i) for i in range(len(self.layers))}
        mask = AttentionMask.build(document_ids, T, x.device, branch_ids, position_ids, dtype=compute, windows=windows)
        aux, last = [], len(self.layers) - 1
        queries = output_rows if cache is None else None  # the last block computes the wanted rows only
        for i, block in enumerate(self.layers):
            angles = local if self.config.is_sliding_layer(i) else rope
            x, block_aux = block(x, angles, mask, cache, queries if i == last else None)
            if block_aux is not None:
                aux.append(block_aux)
        if cache is not None:
            x = keep_rows(x, output_rows)
        return self.norm(x), (torch.stack(aux).mean() if aux else None)

    def forward(self, input_ids, position_ids=None, document_ids=None, cache=None) -> TransformerOutput:
        hidden, aux = self._hidden_states(input_ids, position_ids, document_ids, cache)
        return TransformerOutput(self.lm_head(hidden), aux)

    # -- Hugging Face round-trip -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        adapter: str | Path | None = None, quantize: str | None = None) -> Transformer:
        """Load a Hugging Face checkpoint directory (config.json + safetensors, sharded or not); with `adapter`, a
        PEFT LoRA adapter directory on top of it (kept separate: `merge_lora` folds it in). `quantize="nf4"`:
        the linear weights but the output layer's are read straight into frozen 4-bit NF4 (QLoRA's base, nf4.py),
        one tensor at a time, never the whole model in `dtype`."""
        from .hf import load_pretrained

        if quantize is None:
            model = load_pretrained(cls, path, dtype)
        elif quantize == "nf4":
            from .nf4 import quantize_base, quantize_on_load

            model = quantize_base(load_pretrained(cls, path, dtype, transform=quantize_on_load))
        else:
            raise ValueError(f"quantize={quantize!r}: the only quantisation is 'nf4' (QLoRA's base); pass it or None")
        if adapter is not None:
            from .adapter_files import load_adapter

            load_adapter(model, adapter)
        return model

    def save_pretrained(self, path: str | Path, tokenizer=None, max_shard_size: int = 2 * 1024**3,
                        overwrite: bool = False) -> None:
        """Write a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads; for a model with a
        LoRA adapter, the adapter alone, as a PEFT directory (merge first, `lora.merge_lora`, for a full model).
        Into an existing folder, a file that no export wrote is overwritten only with `overwrite=True` (else
        ExportConflictError); files it does not write are kept."""
        if self.lora_config is not None:
            from .adapter_files import save_adapter

            save_adapter(self, path, tokenizer=tokenizer, overwrite=overwrite)
            return
        from .hf import save_pretrained

        save_pretrained(self, path, tokenizer=tokenizer, max_shard_size=max_shard_size, overwrite=overwrite)
