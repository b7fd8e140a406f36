"""Generation-based evaluation: greedy answers to held-out problems, scored by exact match.

A small decoding loop without a KV cache (each step re-runs the whole sequence): enough for short
answers on small models, and independent of the inference engine. Prompts are encoded exactly as
training encodes them (BOS, the user turn through the chat template, the assistant header), batched
with left padding; the padding is its own document, so no prompt token attends to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..data.formats import encode_rows
from ..data.preprocess import preset_sections
from ..data.synthetic import Problem, accuracy


def chat_prompts(questions: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """The ids a policy continues for each question: what GRPOData yields and SFT rows start with."""
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in questions]
    return [row["prompt_ids"] for row in encode_rows(rows, preset_sections("grpo"), tokenizer, "grpo")]


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
    pad_id: int,
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy continuations of `prompts` (lists of ids), each cut at its first stop id (which is dropped)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)  # (B, T)
    real = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
    )  # 1 = prompt token
    stops = torch.tensor(list(stop_ids), device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out = []
    for _ in range(max_new_tokens):
        positions = (real.cumsum(1) - 1).clamp(min=0)  # (B, T): 0, 1, … over the real tokens
        logits = model(ids, position_ids=positions, document_ids=real).logits  # (B, T, V)
        token = logits[:, -1].argmax(-1)  # (B,)
        token = torch.where(done, pad_id, token)
        out.append(token)
        done |= torch.isin(token, stops)
        if bool(done.all()):
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
        real = torch.cat([real, torch.ones_like(token)[:, None]], dim=1)
    generated = torch.stack(out, dim=1).tolist() if out else [[] for _ in prompts]
    return [_until_stop(row, set(stop_ids)) for row in generated]


def _until_stop(row: list[int], stops: set[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in stops:
            return row[:i]
    return row


def greedy_accuracy(
    model: nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    max_new_tokens: int = 8,
    batch_size: int = 100,
) -> float:
    """Share of `problems` whose greedy answer's last integer equals the right answer (exact match)."""
    was_training = model.training
    model.eval()
    try:
        answers = []
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            prompts = chat_prompts([p.question for p in chunk], tokenizer)
            completions = greedy_decode(
                model, prompts, tokenizer.eos_token_ids, tokenizer.pad_token_id, max_new_tokens
            )
            answers += [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    finally:
        model.train(was_training)
    return accuracy(answers, [p.answer for p in problems])
