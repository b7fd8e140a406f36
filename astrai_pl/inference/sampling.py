"""SamplingParams and the batched sampler: penalties, temperature, top-k / top-p / min-p, seeded draws.

Order of operations on a row of logits (as in Hugging Face's logits processors):
    the request's constraint (logit bias, masks, grammar; `constraints.constrain`) → repetition penalty → frequency / presence penalties → temperature → top-k → top-p → min-p → draw.
A draw inverts the cumulative distribution: with C_i = p_0 + … + p_i (summed in float64) and one
u ~ U[0, C_last), it picks the first token with C_i > u, which samples exactly from p with a single
random number per row; tokens outside the kept set have p = 0, add nothing to C and can never be
picked. A request with a seed draws u from its own generator, so its tokens do not depend on what else
is in the batch. Whatever the logits hold (NaN, ±inf, a temperature of 1e-40), the token is a vocabulary
id: NaN counts as -inf, +inf as the largest float32, and a row without a finite logit gets its argmax.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from .constraints import RowConstraint, check_fields, constrain
from .grammar import StructuredOutput


class SamplingParamsError(ValueError):
    """A SamplingParams field has the wrong type or is out of range."""


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
    top_logprobs: int = 0
    """Also return the `top_logprobs` most likely tokens at each step with their log-probabilities (0..20);
    a value above 0 turns `logprobs` on."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token (from `prompt_logprobs_start` on) and its
    `prompt_logprobs` most likely alternatives (0..20); None computes none. Those positions are never
    taken from the prefix cache, since scoring them needs their logits."""
    prompt_logprobs_start: int = 1
    """The first prompt position scored by `prompt_logprobs` (position 0 has nothing before it)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the completion text."""
    cache_salt: str | None = None
    """Prefix-cache partition (vLLM's name): a request reuses cached prompt pages only of requests with the
    same salt, so a client cannot learn from cache hits what another salt's prompts hold."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of the given token ids before anything else (OpenAI's: at most 300, each in [-100, 100])."""
    min_tokens: int = 0
    """End-of-sequence and stop token ids are masked until this many tokens were generated."""
    bad_words: list[str] = field(default_factory=list)
    """Words never generated: a word's last token is masked whenever its other tokens were just generated."""
    structured: StructuredOutput | None = None
    """A JSON schema, regex, choice list or grammar the output must follow (see `inference.grammar`)."""
    lora_name: str | None = None
    """The LoRA adapter loaded on the engine under this name that computes the request (adapters.py); None:
    the base model."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range (bool is not a number here) and normalise the values.

        Raises SamplingParamsError naming the field, the value and the fix. The engine calls this again
        when a request is added, so fields changed after construction are checked too.
        """
        for name, low, fix in _INTEGER_FIELDS:
            setattr(self, name, _integer(self, name, low, fix))
        for name, in_range, why, fix in _FLOAT_FIELDS:
            setattr(self, name, _real(self, name, in_range, why, fix))
        for name in ("ignore_eos", "logprobs", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(self, name, "must be True or False", f"pass a bool, not {_kind(getattr(self, name))}")
        if self.top_logprobs:
            self.logprobs = True
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer(self, "prompt_logprobs", 0, "use None for no prompt log-probabilities")
        for name in ("top_logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) > MAX_LOGPROBS:
                _fail(self, name, f"must be at most {MAX_LOGPROBS}", f"ask for {MAX_LOGPROBS} or fewer alternatives")
        self.seed = _seed(self)
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and len(self.cache_salt) <= 256):
            _fail(self, "cache_salt", "must be a string of at most 256 characters", "pass a short string or None")
        if self.lora_name is not None and not (isinstance(self.lora_name, str) and self.lora_name):
            _fail(self, "lora_name", "must be a non-empty string", "pass a loaded adapter's name or None")
        self.stop = _stop_strings(self)
        self.stop_token_ids = _stop_token_ids(self)
        check_fields(self, lambda name, why, fix: _fail(self, name, why, fix))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


_FLOAT32_MAX = torch.finfo(torch.float32).max
_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64)

# (field, lowest value, fix)
_INTEGER_FIELDS = (
    ("max_tokens", 0, "use 0 to only prefill, or a positive length"),
    ("top_k", 0, "use 0 to disable top-k"),
    ("n", 1, "ask for at least one completion"),
    ("top_logprobs", 0, "use 0 for the chosen token's log-probability only"),
    ("prompt_logprobs_start", 0, "use 1 to score every prompt token after the first"),
)
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI's API allows
# (field, range check, what the range is, fix)
_FLOAT_FIELDS = (
    ("temperature", lambda x: x >= 0, "must be a finite number >= 0", "use 0 for greedy or e.g. 0.7"),
    ("top_p", lambda x: 0 < x <= 1, "must lie in (0, 1]", "use 1.0 to disable nucleus sampling"),
    ("min_p", lambda x: 0 <= x <= 1, "must lie in [0, 1]", "use 0 to disable min-p"),
    ("repetition_penalty", lambda x: x > 0, "must be > 0", "use 1.0 for no penalty"),
    ("frequency_penalty", lambda x: True, "must be a finite number", "use 0 for no penalty"),
    ("presence_penalty", lambda x: True, "must be a finite number", "use 0 for no penalty"),
)


def _fail(params: SamplingParams, name: str, why: str, fix: str):
    shown = repr(getattr(params, name))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise SamplingParamsError(f"SamplingParams.{name}={shown}: {why}; {fix}")


def _kind(value) -> str:
    return type(value).__name__


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _integer(params: SamplingParams, name: str, low: int, fix: str) -> int:
    value = getattr(params, name)
    if not _is_integer(value):
        _fail(params, name, f"must be a whole number, got {_kind(value)}", fix)
    if value < low:
        _fail(params, name, f"must be >= {low}", fix)
    return int(value)


def _real(params: SamplingParams, name: str, in_range, why: str, fix: str) -> float:
    value = getattr(params, name)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        _fail(params, name, f"must be a number, got {_kind(value)}", fix)
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x) or abs(x) > _FLOAT32_MAX:  # the sampler computes in float32
        _fail(params, name, "must be finite (within ±3.4e38, float32)", fix)
    if not in_range(x):
        _fail(params, name, why, fix)
    return x


def _seed(params: SamplingParams) -> int | None:
    seed = params.seed
    if seed is None:
        return None
    fix = f"use None (the shared generator) or a whole number in [0, 2**64 - n] (n={params.n})"
    if not _is_integer(seed):
        _fail(params, "seed", f"must be a whole number or None, got {_kind(seed)}", fix)
    if not 0 <= seed <= _SEED_LIMIT - params.n:  # sample i of n draws from seed + i
        _fail(params, "seed", "is outside what a torch.Generator takes", fix)
    return int(seed)


def _stop_strings(params: SamplingParams) -> list[str]:
    stop = [params.stop] if isinstance(params.stop, str) else params.stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        _fail(params, "stop", "must be a string or a list of strings", 'pass e.g. ["\\n\\n"]')
    if any(not s for s in stop):
        _fail(params, "stop", "contains an empty string", "remove it")
    return list(stop)


def _stop_token_ids(params: SamplingParams) -> list[int]:
    ids = params.stop_token_ids
    fix = "pass a list of token ids, e.g. [2]"
    if not isinstance(ids, (list, tuple)):
        _fail(params, "stop_token_ids", f"must be a list of ints >= 0, got {_kind(ids)}", fix)
    bad = [t for t in ids if not _is_integer(t) or t < 0]
    if bad:
        _fail(params, "stop_token_ids", f"holds {bad[0]!r}, not a token id (an int >= 0)", fix)
    return [int(t) for t in ids]


def apply_penalties(
    logits: torch.Tensor,  # (V,) float32, modified in place
    params: SamplingParams,
    context: torch.Tensor,  # (L,) int64 prompt + output ids
    output: torch.Tensor,  # (M,) int64 output ids
) -> None:
    """One row's penalties: the reference that `penalise` (every row at once, no host sync) must equal."""
    if params.repetition_penalty != 1 and context.numel():
        seen = context.unique()
        picked = logits[seen]
        logits[seen] = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
    if (params.frequency_penalty or params.presence_penalty) and output.numel():
        counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def penalise(
    logits: torch.Tensor,  # (P, V) float32 of the penalised rows
    params: list[SamplingParams],
    contexts: list[list[int]],  # prompt + output ids of each row
    num_outputs: list[int],
) -> torch.Tensor:
    """`apply_penalties` of every row at once, on the device: one copy of the padded contexts to it and no
    read back. Returns the penalised (P, V) logits.

    For each id t of row r's context: l'[r, t] = l / rep if l > 0 else l · rep (gathered at the context's ids and
    scattered back, so only those entries are touched); then, with counts[r, t] the times t was generated in row r,
    l' − freq · counts − presence · [counts > 0]. Contexts are padded with id V, a column added for the purpose.
    """
    P, V = logits.shape
    width = max(1, max(len(c) for c in contexts))
    lengths = torch.tensor([len(c) for c in contexts])
    at = torch.arange(width)[None]  # (1, W)
    ids = torch.full((2, P, width), V, dtype=torch.int64)  # padding: column V, dropped below
    ids[0][at < lengths[:, None]] = torch.tensor([t for c in contexts for t in c], dtype=torch.int64)
    is_output = (at >= (lengths - torch.tensor(num_outputs))[:, None]) & (at < lengths[:, None])
    ids[1] = torch.where(is_output, ids[0], V)
    ids = to_device(ids, logits.device)  # (2, P, W)
    rates = to_device(torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params], dtype=torch.float32
    ), logits.device)  # (P, 3)
    rep, freq, presence = rates[:, 0:1], rates[:, 1:2], rates[:, 2:3]
    padded = torch.cat([logits, logits.new_zeros(P, 1)], dim=1)  # (P, V+1): column V takes the padding
    if any(p.repetition_penalty != 1 for p in params):  # only the context's entries are read and written
        picked = padded.gather(1, ids[0])  # (P, W); a repeated id reads and writes the same value
        padded.scatter_(1, ids[0], torch.where(picked > 0, picked / rep, picked * rep))
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = torch.zeros_like(padded).scatter_add_(1, ids[1], torch.ones(ids.shape[1:], device=logits.device))
        padded -= freq * counts + presence * (counts > 0).to(logits.dtype)
    return padded[:, :V]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory without waiting for the copy (no host sync)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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


# -- seeded draws: a counter-based generator, u = f(seed, tokens drawn so far) --------------------------------------
def _int64(x: int) -> int:
    """x mod 2**64 as a signed 64-bit integer (what an int64 tensor holds)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)  # logical: int64 tensors shift arithmetically


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (Steele, Lea & Flood, 2014) on int64 tensors; products wrap mod 2**64."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def seeded_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """(N,) float64 in [0, 1): u = mix(mix(seed + γ) + (counter + 1)·γ) / 2**64, to 53 bits.

    A pure function of (seed, counter): a seeded request's n-th draw is the same in any batch, on any device,
    after a preemption, and costs no generator object or launch of its own. seeds, counters: (N,) int64.
    """
    z = _mix(_mix(seeds + _GOLDEN) + (counters + 1) * _GOLDEN)
    return _shift_right(z, 11).to(torch.float64) * 2.0**-53


# -- the batched sampler ------------------------------------------------------------------------------------------
def sample(
    logits: torch.Tensor,  # (N, V) float32 raw model logits, one row per request
    params: list[SamplingParams],
    contexts: list[list[int]],  # prompt + output ids of each request
    num_outputs: list[int],  # how many of those ids are output
    seeds: list[int | None],  # each row's seed (None: the shared generator)
    constraints: list[RowConstraint | None] | None = None,  # each row's bias / masks / grammar (None: none)
) -> tuple[list[int], list[float] | None, list[Alternatives] | None]:
    """The next token of every row; if any row asks, the raw log-probabilities of the chosen tokens and
    each row's `top_logprobs` most likely tokens. Every row is computed together on the logits' device;
    what comes back to the host is one copy of the chosen ids (and log-probabilities), once per call."""
    raw, logits = logits, _finite(logits)  # a new tensor, which the penalties may replace
    if constraints is not None and any(c is not None for c in constraints):
        logits = constrain(logits, constraints, contexts, num_outputs)
    _penalise_rows(logits, params, contexts, num_outputs)
    if all(p.greedy for p in params):
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _draw(logits, params, num_outputs, seeds)
    top = [p.top_logprobs for p in params]
    if not any(p.logprobs for p in params):
        return tokens.tolist(), None, None  # the step's one read back
    columns, k = _score_columns(raw, tokens, top)
    host = torch.cat([tokens[:, None].to(torch.float64), columns], dim=1).tolist()  # the step's one read back
    chosen, alternatives = _unpack([row[1:] for row in host], k, top)
    return [int(row[0]) for row in host], chosen, alternatives


Alternatives = list[tuple[int, float]]  # (token id, log-probability), most likely first


def scored(
    logits: torch.Tensor,  # (N, V) raw logits
    tokens: torch.Tensor,  # (N,) int64: the token each row is scored for
    top: list[int],  # alternatives wanted per row
) -> tuple[list[float], list[Alternatives] | None]:
    """Each row's log-probability of its token, and its `top[i]` most likely tokens (None if no row asks).
    NaN counts as -inf, as in sampling. One copy to the host."""
    columns, k = _score_columns(logits, tokens, top)
    return _unpack(columns.tolist(), k, top)


def _score_columns(logits: torch.Tensor, tokens: torch.Tensor, top: list[int]) -> tuple[torch.Tensor, int]:
    """(N, 1 + 2k) float64 on the device: the chosen token's log-probability, then k top values and k top ids."""
    logp = _finite(logits.float()).log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None])  # (N, 1)
    k = min(max(top, default=0), logp.shape[-1])
    if k == 0:
        return chosen.to(torch.float64), 0
    values, ids = logp.topk(k, dim=-1)
    return torch.cat([chosen.double(), values.double(), ids.double()], dim=1), k


def _unpack(rows: list[list[float]], k: int, top: list[int]) -> tuple[list[float], list[Alternatives] | None]:
    chosen = [row[0] for row in rows]
    if k == 0:
        return chosen, None
    return chosen, [list(zip((int(t) for t in row[1 + k : 1 + k + n]), row[1 : 1 + n])) for row, n in zip(rows, top)]


def _penalise_rows(
    logits: torch.Tensor, params: list[SamplingParams], contexts: list[list[int]], num_outputs: list[int]
) -> None:
    """In place: the penalties of the rows that ask for any (`penalise`)."""
    penalised = [i for i, p in enumerate(params) if p.penalised]
    if penalised:
        rows = to_device(torch.tensor(penalised), logits.device) if len(penalised) < len(params) else slice(None)
        part = [params[i] for i in penalised], [contexts[i] for i in penalised], [num_outputs[i] for i in penalised]
        logits[rows] = _finite(penalise(logits[rows], *part))  # a penalty may overflow a logit to ±inf


def _tempered(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) each row's logits after temperature and top-k / top-p / min-p, what a draw's softmax is taken of;
    and the (N, 6) settings: temperature, top_k, top_p, min_p, truncated, greedy."""
    V = logits.shape[-1]
    knobs = to_device(torch.tensor(
        [[p.temperature or 1.0, min(p.top_k, V), p.top_p, p.min_p, p.truncated, p.greedy] for p in params],
        dtype=torch.float64,
    ), logits.device)  # (N, 6): one copy of every row's settings
    # (l - max) / T: the same distribution as l / T, no overflow however small T is, and for T = 1 the very
    # numbers softmax makes of l itself (it subtracts the max too), so a row draws the same in any batch
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / knobs[:, 0:1].to(torch.float32)
    if any(p.truncated for p in params):
        top_p, min_p = knobs[:, 2].to(torch.float32), knobs[:, 3].to(torch.float32)
        masked = mask_top_k_top_p_min_p(logits, knobs[:, 1].to(torch.int64), top_p, min_p)
        logits = torch.where(knobs[:, 4:5] > 0, masked, logits)  # untruncated rows exactly as alone
    return logits, knobs


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """+inf becomes the largest float32 and NaN becomes -inf (never drawn); -inf stays."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=_FLOAT32_MAX, neginf=float("-inf"))


def _draw(
    logits: torch.Tensor,  # (N, V), no NaN or +inf
    params: list[SamplingParams],
    num_outputs: list[int],
    seeds: list[int | None],
) -> torch.Tensor:
    """One token per row: its argmax for a greedy row, else a draw. A row without probability mass (no finite
    logit) gets its argmax too, so the token is always a vocabulary id."""
    device, N = logits.device, logits.shape[0]
    argmax = logits.argmax(dim=-1)
    logits, knobs = _tempered(logits, params)
    u = torch.rand(N, dtype=torch.float64, device=device)
    if any(s is not None for s in seeds):
        counters = to_device(torch.tensor(
            [[_int64(s or 0), n, s is not None] for s, n in zip(seeds, num_outputs)], dtype=torch.int64
        ), device)  # (N, 3)
        u = torch.where(counters[:, 2] > 0, seeded_uniform(counters[:, 0], counters[:, 1]), u)
    drawn = _inverse_cdf(logits.softmax(dim=-1).double(), u, argmax)  # exact zeros outside the kept set
    return torch.where(knobs[:, 5] > 0, argmax, drawn)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """A draw per row from `probs` (N, V) (unnormalised, float64) with u in [0, 1); `fallback` where a row has
    no mass (NaN or 0: no finite logit in the row)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    massless = ~(total[:, 0] > 0)
    total = torch.where(massless[:, None], torch.ones_like(total), total)
    u = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # u < C_last, always
    drawn = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)
    return torch.where(massless, fallback, drawn)
