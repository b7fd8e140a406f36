"""SamplingParams and the batched sampler: penalties, temperature, top-k / top-p / min-p, seeded draws.

Order of operations on a row of logits (as in Hugging Face's logits processors):
    repetition penalty → frequency / presence penalties → temperature → top-k → top-p → min-p → draw.
A draw inverts the cumulative distribution: with C_i = p_0 + … + p_i (summed in float64) and one
u ~ U[0, C_last), it picks the first token with C_i > u, which samples exactly from p with a single
random number per row; tokens outside the kept set have p = 0, add nothing to C and can never be
picked. A request with a seed draws u from its own generator, so its tokens do not depend on what else
is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class SamplingParamsError(ValueError):
    """A SamplingParams field is out of range."""


@dataclass
class SamplingParams:
    """How one prompt is continued. `temperature=0` is greedy: a plain argmax."""

    max_tokens: int = 256
    """Most tokens to generate (the stop token included)."""
    temperature: float = 1.0
    """Divides the logits; 0 means greedy decoding."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (nucleus sampling); 1 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p × the most likely token's probability; 0 keeps all."""
    repetition_penalty: float = 1.0
    """> 1 discourages every token already in the prompt or output (CTRL, Keskar et al., 2019)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI semantics)."""
    presence_penalty: float = 0.0
    """Subtracted from a token's logit once if it was generated at all (OpenAI semantics)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the completion; the text is cut before the first one."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the completion besides the end-of-sequence ids."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (for benchmarks)."""
    n: int = 1
    """Completions per prompt; they share the prompt's K/V."""
    seed: int | None = None
    """Seed of this request's own generator (sample i of n uses seed + i)."""
    logprobs: bool = False
    """Return the log-probability of each chosen token under the model (before penalties and temperature)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the completion text."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop), [int(t) for t in self.stop_token_ids]

        def fail(name: str, why: str, fix: str) -> None:
            raise SamplingParamsError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}; {fix}")

        if self.max_tokens < 0:
            fail("max_tokens", "must be >= 0", "use 0 to only prefill, or a positive length")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            fail("temperature", "must be a finite number >= 0", "use 0 for greedy or e.g. 0.7")
        if self.top_k < 0:
            fail("top_k", "must be >= 0", "use 0 to disable top-k")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must lie in (0, 1]", "use 1.0 to disable nucleus sampling")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must lie in [0, 1]", "use 0 to disable min-p")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0", "use 1.0 for no penalty")
        if self.n < 1:
            fail("n", "must be >= 1", "ask for at least one completion")
        if any(not s for s in self.stop):
            fail("stop", "contains an empty string", "remove it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def apply_penalties(
    logits: torch.Tensor,  # (V,) float32, modified in place
    params: SamplingParams,
    context: torch.Tensor,  # (L,) int64 prompt + output ids
    output: torch.Tensor,  # (M,) int64 output ids
) -> None:
    if params.repetition_penalty != 1 and context.numel():
        seen = context.unique()
        picked = logits[seen]
        logits[seen] = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
    if (params.frequency_penalty or params.presence_penalty) and output.numel():
        counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def mask_top_k_top_p_min_p(
    logits: torch.Tensor,  # (N, V) float32
    top_k: torch.Tensor,  # (N,) int64, 0 = off
    top_p: torch.Tensor,  # (N,) float32, 1 = off
    min_p: torch.Tensor,  # (N,) float32, 0 = off
) -> torch.Tensor:
    """Logits with every token outside each row's top-k ∩ nucleus ∩ min-p set at -inf. The best token stays."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)
    drop = rank[None] >= torch.where(top_k > 0, top_k, V)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
    drop |= before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(
    logits: torch.Tensor,  # (N, V) float32 raw model logits, one row per request
    params: list[SamplingParams],
    contexts: list[list[int]],  # prompt + output ids of each request
    num_outputs: list[int],  # how many of those ids are output
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[float] | None]:
    """The next token of every row, and the raw log-probabilities of the chosen tokens if any row asks."""
    want_logprobs = any(p.logprobs for p in params)
    raw = logits
    if any(p.penalised for p in params):
        logits = logits.clone()
        for i, p in enumerate(params):
            if p.penalised:
                ctx = torch.tensor(contexts[i], dtype=torch.int64, device=logits.device)
                apply_penalties(logits[i], p, ctx, ctx[len(ctx) - num_outputs[i] :])
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if len(drawn) == len(params):  # every row samples: no argmax to overwrite
        tokens = _draw(logits, params, generators)
    else:
        tokens = logits.argmax(dim=-1)
        if drawn:
            tokens[drawn] = _draw(logits[drawn], [params[i] for i in drawn], [generators[i] for i in drawn])
    token_list = tokens.tolist()
    if not want_logprobs:
        return token_list, None
    chosen = raw.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
    return token_list, chosen.tolist()


def _draw(
    logits: torch.Tensor,  # (M, V)
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    device = logits.device
    if any(p.temperature != 1 for p in params):
        logits = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    if any(p.truncated for p in params):
        logits = mask_top_k_top_p_min_p(
            logits,
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        )
    cdf = logits.softmax(dim=-1).double().cumsum(dim=-1)  # (M, V); exact zeros outside the kept set
    u = torch.empty(len(params), 1, dtype=torch.float64, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[shared] = torch.rand(len(shared), 1, dtype=torch.float64, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=g)
    total = cdf[:, -1:]
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # u < C_last, always
    return torch.searchsorted(cdf, u, right=True)[:, 0]
