"""Both sides of preference pairs in one forward, the prompt they share computed once.

A pair's chosen and rejected sequences begin with the same prompt, and a causal model's hidden state at a
position depends on the tokens up to it only, so the prompt's states are the same on both sides. Instead of
the (2B, T) batch of the two sides, `pair_hidden_states` can run B rows laid out as a prefix tree: the longest
prefix the two sequences share (the trunk), the rest of the chosen sequence, then the rest of the rejected one
at the positions it has in its own sequence, each continuation seeing the trunk and itself only
(`AttentionMask.build` with branch ids). The states are gathered back into the (2B, T) layout the losses read:
the same numbers as the plain forward up to float rounding, the trunk's gradient the sum of both sides'.

A 128-token prompt with two 128-token responses is 384 tokens instead of 512. The tree's rows attend through an
explicit mask over up to 2T keys, where the plain batch takes the causal kernel, so the tree is used only when
the forward and backward FLOPs in the blocks (`model.flops.training_flops` less the output layer: projections
per token, attention per visible query-key pair) fall by at least `MIN_SAVING`; short shared prompts, RWKV and
a dynamic RoPE stretched past its base length keep the plain batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..model.flops import training_flops
from .logprobs import IGNORE_INDEX

MIN_SAVING = 0.1  # the share of the estimated forward work the tree must save to be used
PAD_BRANCH = 3  # the padding after a tree row's two branches: its own branch, seen by no real token


@dataclass
class PairTree:
    input_ids: torch.Tensor  # (B, N): trunk, chosen continuation, rejected continuation, padding
    position_ids: torch.Tensor  # (B, N): each token's position in its own sequence
    branch_ids: torch.Tensor  # (B, N): 0 trunk, 1 chosen, 2 rejected, PAD_BRANCH padding
    gather: torch.Tensor  # (2B, T): the flat tree index holding each position of the (2B, T) layout


def last_scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """Index of each sequence's last token: the last position whose label is not -100 (responses end a sequence,
    padding follows them).  (B, T) → (B,)"""
    positions = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
    return torch.where(labels != IGNORE_INDEX, positions, -1).amax(1).clamp(min=0)


def needed_lengths(labels: torch.Tensor) -> torch.Tensor:
    """How many leading positions of each row the losses read: up to its last scored label (its score, or
    the state before it), at least one.  (B, T) → (B,)"""
    return last_scored_positions(labels) + 1


def pair_tree(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor,
              rejected_len: torch.Tensor) -> PairTree:
    """The prefix-tree layout of B pairs (B, T) each, of which the first `*_len` (B,) tokens are read."""
    B, T = chosen.shape
    reach = torch.minimum(chosen_len, rejected_len)
    same = (chosen == rejected) & (torch.arange(T, device=chosen.device) < reach[:, None])
    trunk = same.long().cumprod(1).sum(1)  # (B,) the longest shared prefix
    width = chosen_len + rejected_len - trunk  # (B,) trunk + both continuations
    j = torch.arange(int(width.max()), device=chosen.device)[None]  # (1, N)
    in_chosen, in_row = j < chosen_len[:, None], j < width[:, None]
    from_rejected = (j - chosen_len[:, None] + trunk[:, None]).clamp(0, T - 1)  # its position there
    ids = torch.where(in_chosen, chosen.gather(1, j.clamp(max=T - 1).expand(B, -1)), rejected.gather(1, from_rejected))
    positions = torch.where(in_chosen, j, from_rejected)
    branch = torch.where(j < trunk[:, None], 0, torch.where(in_chosen, 1, torch.where(in_row, 2, PAD_BRANCH)))
    ids, positions = ids.masked_fill(~in_row, 0), positions.masked_fill(~in_row, 0)
    t = torch.arange(T, device=chosen.device)[None]  # (1, T)
    row = (torch.arange(B, device=chosen.device) * j.shape[1])[:, None]
    chosen_at = torch.where(t < chosen_len[:, None], t, 0)
    rejected_at = torch.where(t < trunk[:, None], t, t - trunk[:, None] + chosen_len[:, None])
    rejected_at = torch.where(t < rejected_len[:, None], rejected_at, 0)
    return PairTree(ids, positions, branch, torch.cat([row + chosen_at, row + rejected_at]))


def _work(cfg, tokens: int, attended_pairs: float) -> float:
    """A forward's and backward's FLOPs in the blocks (`training_flops` without the output layer, which only
    the scored positions reach, as many in either layout)."""
    return training_flops(cfg, tokens, attended_pairs) - 6.0 * cfg.hidden_size * cfg.vocab_size * tokens


def tree_pays(cfg, batch_size: int, seq_len: int, tree_width: int) -> bool:
    """Whether B tree rows of `tree_width` (full masked attention) cost at least MIN_SAVING less than the 2B
    causal rows of `seq_len`."""
    plain = _work(cfg, 2 * batch_size * seq_len, batch_size * seq_len * (seq_len + 1))
    tree = _work(cfg, batch_size * tree_width, batch_size * tree_width**2)
    return tree <= (1 - MIN_SAVING) * plain


def _tree_usable(cfg, seq_len: int) -> bool:
    if cfg is None or getattr(cfg, "mixer", "attention") == "rwkv":
        return False  # a recurrent model has no mask to branch with
    return not (cfg.rope_type == "dynamic" and seq_len > cfg.max_position_embeddings)  # angles follow the row


def pair_hidden_states(model: nn.Module, batch: dict[str, torch.Tensor],
                       at: torch.Tensor | None = None) -> torch.Tensor:
    """Final hidden states of `[chosen; rejected]` (2B, T, H) from a DPOData batch, each shared prompt computed
    once when that pays (see the module's docstring). With `at` (2B,), a position in each of the 2B sequences,
    only the states there (2B, H): the last layer then works for those positions alone (`output_rows`)."""
    chosen, rejected = batch["chosen_input_ids"], batch["rejected_input_ids"]
    B, T = chosen.shape
    cfg = getattr(model, "config", None)
    if B and _tree_usable(cfg, T):
        tree = pair_tree(chosen, rejected, needed_lengths(batch["chosen_labels"]),
                         needed_lengths(batch["rejected_labels"]))
        N = tree.input_ids.shape[1]
        if tree_pays(cfg, B, T, N):
            lengths = torch.full_like(tree.position_ids, T)  # longrope: each side's length in the plain batch
            rows = None if at is None else (tree.gather.gather(1, at[:, None]).view(2, B).t() % N)  # (B, 2)
            hidden, _ = model.hidden_states(tree.input_ids, position_ids=tree.position_ids,
                                            branch_ids=tree.branch_ids, sequence_lengths=lengths, output_rows=rows)
            if at is not None:  # (B, 2, H): each pair's chosen, then its rejected
                return hidden.transpose(0, 1).reshape(2 * B, -1)
            return hidden.reshape(-1, hidden.shape[-1])[tree.gather.flatten()].view(2 * B, T, -1)
    ids = torch.cat([chosen, rejected])
    hidden, _ = model.hidden_states(ids, output_rows=None if at is None else at[:, None])
    return hidden if at is None else hidden[:, 0]
