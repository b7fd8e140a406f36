"""Multi-turn GRPO episodes: the policy and an environment take turns on engine sessions, so each turn
computes only its new tokens; an episode is then shaped like one completion (`Episode`) whose labels keep
the model's tokens and mask what the environment added, and the rollout path (rollout.py) packs it as such.

    model turn → environment.step(conversation) → tool result / next user turn → model turn → … → done

Bounds: at most `max_turns` model turns and `max_tokens` tokens after the prompt (model and environment
together). An environment that raises ends its episode only: reward 0, the error kept in `Episode.error`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..inference import Engine, SamplingParams
from .environments import Environment, EnvStep
from .logprobs import IGNORE_INDEX
from .rewards import score
from .rollout import PROMPT_COLUMNS, reward_inputs

log = logging.getLogger(__name__)

ENDS = ("done", "max_turns", "max_tokens", "error")
_TURN_SEED_STRIDE = 1_000_003  # turn t of a seeded episode samples with seed + t · stride


@dataclass
class Episode:
    """One episode after its prompt, duck-typed as a `Completion` (token_ids, logprobs, text, finish_reason)."""

    token_ids: list[int] = field(default_factory=list)  # model and environment tokens, in order
    trained: list[bool] = field(default_factory=list)  # per token: the model sampled it
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 at environment tokens
    messages: list[dict[str, Any]] = field(default_factory=list)  # the episode's messages (after the prompt)
    end: str = "done"  # one of ENDS
    finish_reason: str = "stop"  # "length" when a bound cut it (mask_truncated_completions drops those)
    reward: float | None = None  # the environment's
    error: str | None = None  # "TypeName: message" of the environment's failure
    text: str = ""  # every token after the prompt, decoded (end tokens left out)

    @property
    def labels(self) -> list[int]:
        """token_ids with IGNORE_INDEX where the environment wrote: the loss sees only the model's tokens."""
        return [t if keep else IGNORE_INDEX for t, keep in zip(self.token_ids, self.trained)]

    @property
    def tool_calls(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "tool")


def conversation(prompt: str | list[dict[str, Any]], episode: Episode) -> list[dict[str, Any]]:
    """The prompt's messages (a plain prompt as one user message) and the episode's."""
    head = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    return head + episode.messages


def render(added: Sequence[dict[str, Any]], held_ids: Sequence[int], messages: list[dict[str, Any]],
           tokenizer: Any, chat: bool) -> list[int]:
    """The ids of the environment's messages after the conversation so far (`held_ids`, `messages`): a tool
    message, or any message of a plain prompt, is its content inline; another role a new chat-template turn,
    what the template adds after the text the session already holds, with the assistant header (after the
    template's own rendering of the history when the model stopped on a token that is not its end of turn)."""
    ids: list[int] = []
    for m in added:
        if m["role"] == "tool" or not chat:
            ids += tokenizer.encode(m["content"])
            continue
        held = tokenizer.decode([*held_ids, *ids])
        before = tokenizer.apply_chat_template(messages, tokenize=False)
        messages = [*messages, dict(m)]
        full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if full.startswith(held):
            ids += tokenizer.encode(full[len(held):])
        elif full.startswith(before):  # the model's stop token is not the template's end of turn
            ids += tokenizer.encode(full[len(before):])
        else:
            raise ValueError(f"the chat template renders the conversation as {full[:80]!r}…, which does not "
                             f"continue its own rendering before the new message; use 'tool' messages")
    return ids


class _Run:
    """The episodes of one rollout in flight: one engine session each."""

    def __init__(self, engine: Engine, prompt_ids, prompts, columns, env: Environment, params: Sequence[SamplingParams],
                 max_turns: int, max_tokens: int):
        self.engine, self.prompt_ids, self.prompts, self.columns = engine, prompt_ids, prompts, columns
        self.env, self.params, self.max_turns, self.max_tokens = env, params, max_turns, max_tokens
        self.episodes = [Episode() for _ in prompt_ids]
        self.end_ids = set(engine.eos_token_ids)

    def model_turn(self, i: int, turn: int, new_ids: list[int], session) -> Any:
        room = self.max_tokens - len(self.episodes[i].token_ids)
        p = self.params[i]
        params = replace(p, max_tokens=min(p.max_tokens, room), stop=[*p.stop, *self.env.stop], n=1,
                         seed=None if p.seed is None else p.seed + turn * _TURN_SEED_STRIDE)
        return session.submit(new_ids, params)

    def take_reply(self, i: int, completion) -> None:
        ep, tok = self.episodes[i], self.engine.tokenizer
        ep.token_ids += completion.token_ids
        ep.trained += [True] * len(completion.token_ids)
        ep.logprobs += list(completion.logprobs or [0.0] * len(completion.token_ids))
        content = tok.decode([t for t in completion.token_ids if t not in self.end_ids])
        if ep.messages and ep.messages[-1]["role"] == "assistant":  # none came between: one turn
            ep.messages[-1]["content"] += content
        else:
            ep.messages.append({"role": "assistant", "content": content})
        if completion.finish_reason not in ("stop", "length"):
            self.finish(i, "error", error=f"engine: {completion.error or completion.finish_reason}")

    def env_turn(self, i: int, turn: int) -> list[int] | None:
        """The ids the environment adds before model turn `turn` + 1, or None when the episode ended."""
        ep = self.episodes[i]
        if ep.end == "error":
            return None
        messages = conversation(self.prompts[i], ep)
        try:
            result: EnvStep = self.env(messages, self.columns[i])
            added = render(result.messages, [*self.prompt_ids[i], *ep.token_ids], messages,
                           self.engine.tokenizer, isinstance(self.prompts[i], list)) if not result.done else []
        except Exception as err:  # an environment's bug ends its own episode only
            log.warning("environment %s raised %s: %s; the episode ends with reward 0", self.env.name,
                        type(err).__name__, err)
            return self.finish(i, "error", error=f"{type(err).__name__}: {err}")
        if result.done:
            return self.finish(i, "done", reward=result.reward)
        if turn + 1 >= self.max_turns:
            return self.finish(i, "max_turns")
        if len(ep.token_ids) + len(added) >= self.max_tokens:
            return self.finish(i, "max_tokens")
        ep.messages += [dict(m) for m in result.messages]
        ep.token_ids += added
        ep.trained += [False] * len(added)
        ep.logprobs += [0.0] * len(added)
        return added

    def finish(self, i: int, end: str, reward: float | None = None, error: str | None = None) -> None:
        ep = self.episodes[i]
        ep.end, ep.reward, ep.error = end, (0.0 if end == "error" else reward), error
        ep.finish_reason = "length" if end in ("max_turns", "max_tokens") else "stop"
        ep.text = self.engine.tokenizer.decode([t for t in ep.token_ids if t not in self.end_ids])
        return None


def run_episodes(engine: Engine, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any],
                 columns: Sequence[dict[str, Any]], env: Environment, params: Sequence[SamplingParams],
                 max_turns: int, max_tokens: int) -> list[Episode]:
    """One episode per entry (prompts already repeated per group), all in flight together: every turn
    submits the active episodes' new tokens to their sessions and waits for all of them."""
    run = _Run(engine, prompt_ids, prompts, columns, env, params, max_turns, max_tokens)
    sessions = [engine.session() for _ in prompt_ids]
    try:
        pending = {i: list(p) for i, p in enumerate(prompt_ids)}
        for turn in range(max_turns):
            handles = {i: run.model_turn(i, turn, new, sessions[i]) for i, new in pending.items()}
            for i, handle in handles.items():
                handle.wait()
                [completion] = handle.result()
                run.take_reply(i, completion)
            pending = {}
            for i in handles:
                if len(run.episodes[i].token_ids) >= max_tokens and run.episodes[i].end != "error":
                    run.finish(i, "max_tokens")
                elif (added := run.env_turn(i, turn)) is not None:
                    pending[i] = added
    finally:
        for session in sessions:
            session.close()
    return run.episodes


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """episodes/mean_turns (model turns), mean_tool_calls, mean_env_tokens, the share of each way an episode
    ended (episodes/end_<done|max_turns|max_tokens|error>) and episodes/errors (a count)."""
    n = max(len(episodes), 1)
    turns = [sum(1 for m in e.messages if m["role"] == "assistant") for e in episodes]
    metrics = {
        "episodes/mean_turns": sum(turns) / n,
        "episodes/mean_tool_calls": sum(e.tool_calls for e in episodes) / n,
        "episodes/mean_env_tokens": sum(e.trained.count(False) for e in episodes) / n,
        "episodes/errors": float(sum(e.end == "error" for e in episodes)),
    }
    metrics.update({f"episodes/end_{end}": sum(e.end == end for e in episodes) / n for end in ENDS})
    return metrics


def row_columns(batch: dict[str, list], group_size: int) -> list[dict[str, Any]]:
    """Each episode's row columns other than the prompt (e.g. `answer`), for the environment's step."""
    keys = [k for k in batch if k not in PROMPT_COLUMNS]
    return [{k: batch[k][i // group_size] for k in keys} for i in range(len(batch["prompt_ids"]) * group_size)]


def score_episodes(funcs: Sequence[tuple[str, Any]], weights: Sequence[float], batch: dict[str, list],
                   episodes: Sequence[Episode], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-function rewards (N, F + 1), the environment's last, and the totals (N,):

        R_i = Σ_f w_f · r_{i,f} + r_env,i       (0 for an episode whose environment raised)

    Reward functions see conversational episodes as their messages (the last is the model's final turn)."""
    prompts, shown, columns = reward_inputs(batch, episodes, group_size)
    if isinstance(prompts[0], list):
        shown = [[dict(m) for m in e.messages] for e in episodes]
    n = len(episodes)
    per_func, total = score(funcs, weights, prompts, shown, columns) if funcs else (torch.zeros(n, 0), torch.zeros(n))
    env = torch.tensor([math.nan if e.reward is None else float(e.reward) for e in episodes])  # (N,)
    failed = torch.tensor([e.end == "error" for e in episodes])
    total = (total + env.nan_to_num(0.0)).masked_fill(failed, 0.0)
    return torch.cat([per_func, env[:, None]], dim=1), total
