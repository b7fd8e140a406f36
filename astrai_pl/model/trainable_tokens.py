"""Trainable tokens: a few rows of the embedding trained beside a LoRA adapter (PEFT's `trainable_token_indices`).

A LoRA run freezes the embedding. A token the base never saw in training (a chat template's `<|im_start|>` and
`<|im_end|>`, added to the tokenizer for fine-tuning) then keeps its random row for good: as an input it is
noise, and under tied embeddings the same row is the output layer's, so the model can hardly learn to *emit* it
(to end its turn). `trainable_token_indices` names such tokens; only their rows train:

    E' = E with the rows idx replaced by R,    R: (n, hidden), initialised to E[idx]

Every other row, and E itself, stays frozen. With tied embeddings the output layer computes its logits from the
same E' (PEFT ties its token adapter to the lm_head the same way). The field takes token ids or token strings
(`["<|im_start|>", "<|im_end|>"]`, resolved with the run's tokenizer), as a list (the input embedding) or as
`{embed_tokens: [...]}`, PEFT's per-module form; `all` trains every row, which with tied embeddings is the
whole output layer too (a tied model cannot name `embed_tokens` in `modules_to_save`; an adapter saves the ids
0..V-1, as PEFT would write that list).

R is saved as PEFT saves it, `base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta`
(n, hidden): despite PEFT's name, the new rows themselves, not a difference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError
from .layers import Linear

FIELD = "model.init_args.lora.trainable_token_indices"
EMBEDDING = "embed_tokens"
ALL = "all"  # every row
ROWS_KEY = "embed_tokens.token_rows"  # our state-dict key of R


def check_token_indices(value: Any) -> None:
    """ConfigError unless `value` is None, "all", a non-empty list of ids/token strings, or {embed_tokens: that
    list}."""
    entries = value.get(EMBEDDING) if isinstance(value, dict) and set(value) == {EMBEDDING} else value
    if value is None or value == ALL:
        return
    if not (isinstance(entries, (list, tuple)) and entries and all(
            isinstance(e, str) and e or isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in entries)):
        raise ConfigError(f"{FIELD}={value!r}: give a list of token ids or token strings (e.g. ['<|im_start|>', "
                          "'<|im_end|>']), {embed_tokens: [...]} or all; only the input embedding (and an output layer "
                          "tied to it) can train single tokens here")


def token_ids(value: list | dict | str, tokenizer: Any, vocab_size: int) -> list[int]:
    """The sorted, distinct ids `value` names; token strings resolved with `tokenizer`. ConfigError for a string
    the tokenizer does not know (or no tokenizer), or an id past the embedding. "all": every id."""
    if value == ALL:
        return list(range(vocab_size))
    entries = value[EMBEDDING] if isinstance(value, dict) else value
    found = set()
    for entry in entries:
        if isinstance(entry, str):
            resolved = tokenizer.token_to_id(entry) if tokenizer is not None else None
            if resolved is None:
                why = "no tokenizer was given to resolve it" if tokenizer is None else "the tokenizer has no such token"
                raise ConfigError(f"{FIELD}: {entry!r}: {why}. Fix: name a token of the run's tokenizer (its "
                                  "special tokens, e.g. the chat template's), or give its id")
            entry = resolved
        if entry >= vocab_size:
            raise ConfigError(f"{FIELD}: id {entry} is past the embedding's {vocab_size} rows; give ids below it")
        found.add(int(entry))
    return sorted(found)


class TokenEmbedding(nn.Embedding):
    """An embedding whose rows `token_indices` are `token_rows` (trained); `weight` is the frozen base's own
    parameter, so the state-dict key `embed_tokens.weight` and the base's export are unchanged."""

    def __init__(self, base: nn.Embedding, indices: list[int]):
        nn.Module.__init__(self)
        for attr in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, attr, getattr(base, attr))
        self.weight = base.weight
        index = torch.tensor(indices, dtype=torch.long, device=base.weight.device)
        self.register_buffer("token_indices", index, persistent=False)
        self.token_rows = nn.Parameter(base.weight.detach()[index].clone())  # (n, hidden)
        self.every_row = indices == list(range(self.num_embeddings))  # E' is R itself: no (V, hidden) copy
        self.enabled = True

    def merged_weight(self) -> torch.Tensor:
        """E' (V, hidden): the base's rows with the trained ones in place (E itself while switched off)."""
        if not self.enabled:
            return self.weight
        if self.every_row:
            return self.token_rows.to(self.weight.dtype)
        return self.weight.index_copy(0, self.token_indices, self.token_rows.to(self.weight.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.merged_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trainable_tokens={self.token_indices.tolist()}"


class TokenHead(Linear):
    """The output layer tied to a TokenEmbedding: its logits come from the embedding's E'. The embedding is
    held outside the module tree (its parameters are named once, under embed_tokens)."""

    def __init__(self, base: Linear, embedding: TokenEmbedding):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.__dict__["embedding"] = embedding

    def merged_weight(self) -> torch.Tensor:
        return self.embedding.merged_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.merged_weight(), self.bias)  # (…, V)


def add_trainable_tokens(model: nn.Module, value: list | dict | str, tokenizer: Any) -> list[int]:
    """Give `model` (its parameters already frozen) trainable rows for the tokens `value` names; the ids."""
    indices = token_ids(value, tokenizer, model.config.vocab_size)
    embedding = TokenEmbedding(model.embed_tokens, indices)
    model.embed_tokens = embedding
    if model.config.tie_word_embeddings:
        if type(model.lm_head) is not Linear:
            raise ConfigError(f"{FIELD}: the output layer of this model is a {type(model.lm_head).__name__} (an "
                              "adapter or a soft-capped head), which trainable tokens cannot share; leave lm_head "
                              "out of target_modules, or leave trainable_token_indices out")
        model.lm_head = TokenHead(model.lm_head, embedding)
    return indices


def remove_trainable_tokens(model: nn.Module, keep: bool) -> None:
    """Put a plain embedding (and tied output layer) back: with the trained rows written into E when `keep`,
    the base's rows otherwise. In place."""
    embedding = model.embed_tokens
    if not isinstance(embedding, TokenEmbedding):
        return
    plain = nn.Embedding(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, device="meta")
    weight = embedding.weight
    if keep:
        with torch.no_grad():
            weight.index_copy_(0, embedding.token_indices, embedding.token_rows.to(weight.dtype))
    plain.weight = weight
    model.embed_tokens = plain
    if isinstance(model.lm_head, TokenHead):
        head = Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False, device="meta")
        head.weight, head.bias = weight, model.lm_head.bias
        model.lm_head = head


def token_modules(model: nn.Module) -> list[TokenEmbedding]:
    return [m for m in model.modules() if isinstance(m, TokenEmbedding)]
