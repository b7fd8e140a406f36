"""Speculative decoding with prompt lookup (n-gram proposals), verified by the target model in one forward.

    engine = Engine(model, tok, speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4))

Each step, a decoding request whose context (prompt + output) ends with an n-gram seen earlier in it gets the
tokens that followed that earlier occurrence as a draft d_1..d_k (longest n first, from prompt_lookup_max down
to prompt_lookup_min; the latest occurrence wins). The forward computes its last sampled token and the k drafts
together, an extend step of 1 + k tokens after its cached prefix, and yields k + 1 rows of logits: row i is the
target's distribution p_i for the position of d_{i+1} (row k: the one after d_k).

Verification (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding", with a
point-mass draft q = δ(d)): walk the rows; accept d_{i+1} with probability p_i(d_{i+1}); at the first
rejection draw from p_i with d_{i+1} removed and renormalised, and stop; if every draft is accepted draw one
more token from p_k. For any token y:  P(y) = p(y)·[y = d] + (1 − p(d))·p(y)/(1 − p(d))·[y ≠ d] = p(y),
so the output has the target's distribution. p is the distribution the plain sampler draws from, penalties,
temperature, top-k, top-p and min-p applied, each row with the context that precedes it; a greedy row is a
point mass on its argmax, so greedy output is the same as without speculation.

The K/V of rejected drafts is rolled back (the request's length and pages cut back before any token is added),
so the radix cache only ever sees accepted tokens; a request never emits past max_tokens, a stop id or a stop
string, since accepted tokens are added one at a time through the same `Request.append`. Drafted steps run
eagerly: a recorded decode step (decode_graphs.py) only replays one-token decodes.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from .pool import EngineConfigError
from .recurrent.runner import is_recurrent
from .request import Request
from .sampling import (
    Alternatives,
    SamplingParams,
    _finite,
    _int64,
    _inverse_cdf,
    _penalise_rows,
    _score_columns,
    _tempered,
    _unpack,
    seeded_uniform,
    to_device,
)

_ACCEPT_STREAM = 1 << 48  # seeded acceptance draws use counters from here; token draws use the output index


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config` for the n-gram method (prompt lookup)."""

    method: str = "ngram"
    """How drafts are proposed; "ngram" (prompt lookup) is the one method."""
    num_speculative_tokens: int = 4
    """Most draft tokens verified per request per step (k)."""
    prompt_lookup_max: int | None = None
    """Longest n-gram matched against the earlier context (default 4)."""
    prompt_lookup_min: int | None = None
    """Shortest n-gram matched (default: 2, or prompt_lookup_max if smaller)."""

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise EngineConfigError(f"speculative method={self.method!r} is not supported; use \"ngram\"")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EngineConfigError(f"speculative {name}={value!r} must be a whole number >= 1")
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = max(4, self.prompt_lookup_min or 0)
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = min(2, self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise EngineConfigError(
                f"speculative prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max="
                f"{self.prompt_lookup_max}; lower the first or raise the second"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config from vLLM's `--speculative-config` JSON; unknown keys are refused by name."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise EngineConfigError(f"--speculative-config is not JSON ({err}); pass e.g. "
                                    '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(values, dict):
            raise EngineConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise EngineConfigError(f"--speculative-config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


class NgramIndex:
    """Where each token id occurs in a request's context, kept up to date as the context grows."""

    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}
        self.size = 0

    def update(self, tokens: list[int]) -> None:
        for i in range(self.size, len(tokens)):
            self.positions.setdefault(tokens[i], []).append(i)
        self.size = len(tokens)


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int, index: NgramIndex | None = None) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the context's last n tokens: the longest n in
    [n_min, n_max] that occurs, its latest occurrence; [] when none does. Only the earlier positions of the last
    token are examined (`index`, built here when not given)."""
    if index is None:
        index = NgramIndex()
    index.update(tokens)
    size = len(tokens)
    best, best_n = -1, n_min - 1
    for end in reversed(index.positions.get(tokens[-1], [])[:-1]):  # latest first; the suffix itself left out
        n = 1
        while n < n_max and end - n >= 0 and tokens[end - n] == tokens[size - 1 - n]:
            n += 1
        if n > best_n:
            best, best_n = end, n
            if n == n_max:
                break
    return [] if best < 0 else tokens[best + 1 : best + 1 + k]


def target_probs(
    logits: torch.Tensor,  # (N, V) float32 raw logits
    params: list[SamplingParams],
    contexts: list[list[int]],  # the ids each row follows (prompt + output)
    num_outputs: list[int],
) -> torch.Tensor:
    """(N, V) float64: the distribution the plain sampler (`sampling.sample`) draws each row from, with the
    same operations in the same order; a greedy row (or one without a finite logit) is one-hot at its argmax."""
    x = _finite(logits)
    _penalise_rows(x, params, contexts, num_outputs)
    argmax = x.argmax(dim=-1)
    x, knobs = _tempered(x, params)
    probs = x.softmax(dim=-1).double()  # (N, V)
    point = ~(probs.sum(dim=-1) > 0) | (knobs[:, 5] > 0)  # massless or greedy: the argmax
    one_hot = torch.zeros_like(probs).scatter_(1, argmax[:, None], 1.0)
    return torch.where(point[:, None], one_hot, probs)


class Verified(NamedTuple):
    """A drafted request's outcome: the tokens to add (accepted drafts, then one drawn), their log-probs."""

    req: Request
    tokens: list[int]
    logprobs: list[float] | None
    top: list[Alternatives] | None
    drafted: int


def verify_drafts(
    logits: torch.Tensor,  # (R, V) raw: each request's 1 + len(draft) rows, in order
    reqs: list[Request],
) -> list[Verified]:
    """Accept or reject every request's draft against the target rows (module docstring), all rows at once on
    the logits' device; one read back. Log-probabilities are the target's raw ones, as the plain sampler's."""
    params, contexts, outputs, draft_ids, seeds = [], [], [], [], []
    for req in reqs:
        seq = req.tokens + req.draft
        for i in range(len(req.draft) + 1):
            params.append(req.params)
            contexts.append(seq[: len(req.tokens) + i] if req.params.penalised else [])  # read only if penalised
            outputs.append(len(req.tokens) + i - req.num_prompt)
            draft_ids.append(req.draft[i] if i < len(req.draft) else -1)
            seeds.append(req.seed)
    device = logits.device
    probs = target_probs(logits, params, contexts, outputs)  # (R, V)
    draft = to_device(torch.tensor(draft_ids), device)  # (R,), -1: the row after the last draft
    has = draft >= 0
    at = draft.clamp_min(0)[:, None]
    total = probs.sum(dim=-1)
    p_draft = torch.where(has, probs.gather(1, at)[:, 0] / total, torch.zeros_like(total))
    residual = torch.where(has[:, None], probs.scatter(1, at, 0.0), probs)  # the draft removed
    accept_u, draw_u = _uniforms(seeds, outputs, device)
    accept = accept_u < p_draft  # (R,)
    drawn = _inverse_cdf(residual, draw_u, probs.argmax(dim=-1))
    chosen = torch.where(accept, draft, drawn)
    top = [p.top_logprobs for p in params]
    columns = [accept.double()[:, None], chosen.double()[:, None]]
    scoring = any(p.logprobs for p in params)
    if scoring:
        scores, k = _score_columns(logits, chosen, top)
        columns.append(scores)
    host = torch.cat(columns, dim=1).tolist()  # the step's one read back
    chosen_lp, alternatives = _unpack([row[2:] for row in host], k, top) if scoring else (None, None)
    return _walk(reqs, host, chosen_lp, alternatives)


def _uniforms(seeds: list[int | None], outputs: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(R,) float64 pairs in [0, 1): the acceptance test's and the draw's; a seeded row's are functions of its
    seed and output index (as the plain sampler's draws), so they do not depend on the batch."""
    R = len(seeds)
    accept_u = torch.rand(R, dtype=torch.float64, device=device)
    draw_u = torch.rand(R, dtype=torch.float64, device=device)
    if any(s is not None for s in seeds):
        counters = to_device(torch.tensor(
            [[_int64(s or 0), n, s is not None] for s, n in zip(seeds, outputs)], dtype=torch.int64
        ), device)  # (R, 3)
        seeded = counters[:, 2] > 0
        accept_u = torch.where(seeded, seeded_uniform(counters[:, 0], counters[:, 1] + _ACCEPT_STREAM), accept_u)
        draw_u = torch.where(seeded, seeded_uniform(counters[:, 0], counters[:, 1]), draw_u)
    return accept_u, draw_u


def _walk(reqs, host, chosen_lp, alternatives) -> list[Verified]:
    """Each request's accepted drafts and the token drawn at the first rejection (or after the last draft)."""
    out, row = [], 0
    for req in reqs:
        tokens, rows = [], []
        for i in range(len(req.draft) + 1):
            accepted, token = host[row + i][0] > 0, int(host[row + i][1])
            tokens.append(token)
            rows.append(row + i)
            if not accepted:
                break
        logprobs = [chosen_lp[r] for r in rows] if chosen_lp is not None and req.params.logprobs else None
        top = [alternatives[r] for r in rows] if alternatives is not None and req.params.top_logprobs else None
        out.append(Verified(req, tokens, logprobs, top, len(req.draft)))
        row += len(req.draft) + 1
    return out


class SpeculativeSteps:
    """The engine's side of speculation: drafts before scheduling, verification after the forward, the rollback
    of rejected drafts' memory. A mixin of `Engine`, which gives it `speculative`, `scheduler`,
    `max_context`, `_counts` and `_append`."""

    def _propose_drafts(self) -> None:
        """A draft for every running request that decodes its next token now (not a session's turn: its memory
        goes back to the session exactly as computed; not a constrained request: a grammar, logit_bias, bad words
        or min_tokens change the distribution each drafted position would be verified against)."""
        cfg = self.speculative
        if not hasattr(self, "_ngram_indexes"):  # each request's index, dropped with the request
            self._ngram_indexes: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()
        for req in self.scheduler.running:
            if (req.remaining != 1 or len(req.tokens) <= req.num_prompt or not req.prompt_cached
                    or req.ready_logits is not None or req.session is not None
                    or req.constraint is not None):
                continue
            room = min(cfg.num_speculative_tokens, req.params.max_tokens - (len(req.tokens) - req.num_prompt) - 1,
                       self.max_context - len(req.tokens) - 1)
            if room > 0:
                index = self._ngram_indexes.setdefault(req, NgramIndex())
                req.draft = propose_ngram(req.tokens, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max, index)

    def _split_verified(self, ready: list[Request], logits: torch.Tensor | None):
        """The forward's ready requests without a draft and their logits rows, and the drafted ones verified."""
        if not any(req.draft for req in ready):
            return ready, logits, []
        plain, plain_rows, drafted, drafted_rows, row = [], [], [], [], 0
        for req in ready:
            rows = list(range(row, row + len(req.draft) + 1))
            (drafted if req.draft else plain).append(req)
            (drafted_rows if req.draft else plain_rows).extend(rows)
            row += len(rows)
        verified = verify_drafts(logits[drafted_rows], drafted)
        return plain, logits[plain_rows], verified

    def _commit_verified(self, v: Verified) -> list:
        """Cut the request back to its accepted drafts (rejected ones' K/V and pages dropped), then add the tokens
        one at a time, stopping where the request ends."""
        req, accepted = v.req, len(v.tokens) - 1
        length = len(req.tokens)
        req.draft = []
        assert req.num_computed == length + v.drafted, "a verified request computed its whole draft"
        self.scheduler.trim(req, length + accepted)
        req.num_computed = length
        self._counts["draft_tokens"] += v.drafted
        self._counts["accepted_draft_tokens"] += accepted
        deltas = []
        for i, token in enumerate(v.tokens):
            logprob = v.logprobs[i] if v.logprobs is not None else None
            delta = self._append(req, token, logprob, v.top[i] if v.top is not None else None)
            deltas.append(delta)
            if delta.finish_reason is not None:
                break
            if i < accepted:
                req.num_computed += 1  # an accepted draft: its K/V was computed by this step
        return deltas

    def _drop_drafts(self) -> None:
        """After a step that failed before its drafts were verified: forget them and the memory taken for them."""
        if self.speculative is None:  # no request has a draft: nothing to walk on every step
            return
        for req in self.scheduler.running:
            if req.draft:
                req.draft = []
                req.num_computed = min(req.num_computed, len(req.tokens))
                self.scheduler.trim(req, req.num_computed)


def check_speculative_model(model, speculative: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
    """The engine's speculative config, refused for models whose state or positions cannot be rolled back."""
    if speculative is None:
        return None
    if isinstance(speculative, dict):
        speculative = SpeculativeConfig(**speculative)
    if not isinstance(speculative, SpeculativeConfig):
        raise EngineConfigError(f"speculative={speculative!r}: pass a SpeculativeConfig, a dict or None")
    cfg = model.config
    if is_recurrent(model):
        raise EngineConfigError("speculative decoding needs an attention model (a recurrent state cannot be "
                                "rolled back past rejected drafts); leave speculative=None")
    if getattr(getattr(model, "rotary", None), "per_sequence", False) or any(
            cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)):
        raise EngineConfigError("speculative decoding does not support longrope or sliding-window models yet; "
                                "leave speculative=None")
    return speculative


__all__ = ["SpeculativeConfig", "propose_ngram", "target_probs", "verify_drafts"]
