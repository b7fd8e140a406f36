"""The teachers of `Distill`: a model we load (any checkpoint or Hugging Face directory), which gives its
whole next-token distribution, or a model behind an OpenAI-compatible server, which gives its top-k
log-probabilities of each token of a sequence (`/v1/completions` with `echo`, `logprobs: k` and vLLM's
`return_tokens_as_token_ids`, which `astrai-pl serve` and vLLM both answer)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from ..checkpoint import load_transformer
from ..data.packing import IGNORE_INDEX
from ..model import ConfigError
from .base import frozen_copy
from .logprobs import scored_rows


class TeacherError(RuntimeError):
    """A teacher server that cannot be reached or answers what a teacher must not (names the fix)."""


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """labels shifted one left: the token each position predicts, -100 where it is not trained.  (B, T)"""
    return torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), IGNORE_INDEX)], dim=1)


class ModelTeacher:
    """A frozen model we load: `path` is a Hugging Face directory or an astrai-pl .ckpt."""

    def __init__(self, path: str):
        self.path = path
        self.model = frozen_copy(load_transformer(None, path))

    def on(self, device: torch.device) -> torch.nn.Module:
        """The teacher's model on `device` (kept out of the student's module tree: no checkpoint holds it)."""
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        return self.model

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The teacher's next-token logits at each trained position, in `scored_rows` order.  (N, V)"""
        self.on(input_ids.device)
        hidden, _ = self.model.hidden_states(input_ids)
        rows, _, _ = scored_rows(hidden, next_token_targets(labels))  # (N, H)
        return self.model.lm_head(rows)  # (N, V)


class ServerTeacher:
    """A teacher behind an OpenAI-compatible server at `url` (its base, without /v1), asked for the top_k
    log-probabilities at every position of each sequence. `client`: an httpx.Client-like object (tests)."""

    def __init__(self, url: str, model: str | None, top_k: int, api_key_env: str | None = None,
                 timeout: float = 60.0, client: Any = None):
        try:
            import httpx
        except ImportError as err:
            raise ConfigError("Distill.teacher_url needs the httpx package: pip install 'astrai-pl[serve]'") from err
        self.url, self.model, self.top_k = url.rstrip("/"), model, top_k
        headers = {}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ConfigError(f"Distill.teacher_api_key_env={api_key_env!r}: that environment variable is not "
                                  "set; export it with the server's API key, or set teacher_api_key_env: null")
            headers["Authorization"] = f"Bearer {key}"
        self.client = client or httpx.Client(timeout=timeout, headers=headers)

    def sequence_top_logprobs(self, ids: Sequence[int]) -> list[dict[int, float] | None]:
        """For each token of `ids`, the teacher's top-k {token id: log-prob} at its position (None for the first)."""
        body = {"prompt": [int(i) for i in ids], "max_tokens": 1, "echo": True, "logprobs": self.top_k,
                "temperature": 0.0, "return_tokens_as_token_ids": True}
        if self.model is not None:
            body["model"] = self.model
        try:
            response = self.client.post(f"{self.url}/v1/completions", json=body)
        except Exception as err:  # httpx.HTTPError and transport errors alike
            raise TeacherError(f"the teacher server at {self.url} could not be reached ({err}); start it or fix "
                               "Distill.teacher_url") from err
        if response.status_code != 200:
            raise TeacherError(f"the teacher server at {self.url} answered {response.status_code}: "
                               f"{response.text[:300]}")
        try:
            tops = response.json()["choices"][0]["logprobs"]["top_logprobs"]
            return [None if top is None else {_token_id(name): _logprob(lp) for name, lp in top.items()}
                    for top in tops[: len(ids)]]
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise TeacherError(f"the teacher server at {self.url} returned no echoed top logprobs by token id "
                               f"({err}); it must answer /v1/completions with echo, logprobs and "
                               "return_tokens_as_token_ids (astrai-pl serve and vLLM do)") from err

    def top_logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k ids and log-probabilities at each trained position, in `scored_rows` order,
        rows with fewer than k padded with the row's first id at −inf.  (N, K), (N, K)"""
        targets = next_token_targets(labels)
        ids, logps = [], []
        for row, target in zip(input_ids.tolist(), targets):
            positions = (target != IGNORE_INDEX).nonzero().squeeze(-1).tolist()
            if not positions:
                continue
            tops = self.sequence_top_logprobs(row[: positions[-1] + 2])  # up to the last trained token
            for t in positions:
                top = tops[t + 1] if t + 1 < len(tops) else None  # the distribution the token at t + 1 came from
                if not top:
                    raise TeacherError(f"the teacher server at {self.url} returned no top logprobs at position "
                                       f"{t + 1} of a sequence of {len(row)} tokens")
                pairs = sorted(top.items(), key=lambda kv: -kv[1])[: self.top_k]
                pad = self.top_k - len(pairs)
                ids.append([i for i, _ in pairs] + [pairs[0][0]] * pad)
                logps.append([lp for _, lp in pairs] + [float("-inf")] * pad)
        device = input_ids.device
        return (torch.tensor(ids, dtype=torch.long, device=device).view(-1, self.top_k),
                torch.tensor(logps, dtype=torch.float32, device=device).view(-1, self.top_k))


def _token_id(name: str) -> int:
    if not name.startswith("token_id:") or not name[len("token_id:"):].isdigit():
        raise ValueError(f"a token named {name!r}, not 'token_id:<id>'")
    return int(name[len("token_id:"):])


def _logprob(value: Any) -> float:
    """A log-probability as a float <= 0 (a NaN or a positive one from a server would poison the loss)."""
    lp = float(value)
    if not (lp <= 0.0 and math.isfinite(lp)):
        raise ValueError(f"a log-probability of {value!r}")
    return lp
