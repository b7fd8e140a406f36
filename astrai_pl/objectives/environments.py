"""Environments for multi-turn GRPO episodes: what answers the policy between its turns, and the episode's reward.

The protocol (docs/objectives.md, "Multi-turn episodes"):

    step(messages, **columns) -> EnvStep(messages=[…], done=False, reward=None)

After each model turn the environment sees the whole conversation so far — the prompt's messages (a plain
prompt is one user message), then the episode's own: the model's turns as `assistant` messages and what
the environment added before — and the row's other columns (e.g. `answer`). It returns the messages to
add (tool results, the next user turn), whether the episode is over, and, when it is, a reward (None: the
reward functions alone score it). A `tool` message continues the model's turn inline (its content is
appended as is); any other role opens a new turn through the tokenizer's chat template. Nothing the
environment adds is trained on.

An environment is a function with that signature, or an object with a `step` method (a class named by
import path is instantiated with the spec's kwargs). An optional `stop` attribute lists stop strings that
end a model turn so the environment can answer (e.g. `"</calc>"`).
"""

from __future__ import annotations

import ast
import inspect
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..data.synthetic import exact_match
from .rewards import RewardError, RewardSpec, load_reward_func, spec_name


class EnvironmentSpecError(RewardError):
    """An environment cannot be loaded, or returned something that is not an EnvStep."""


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one model turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """Messages added to the conversation ({"role": …, "content": …}); masked out of the loss."""
    done: bool = False
    """The episode ends here (no more model turns)."""
    reward: float | None = None
    """The episode's reward when done; None leaves it to the reward functions."""


@dataclass
class Environment:
    """A loaded environment: its name (metrics), its step function and its stop strings."""

    name: str
    step: Callable[..., EnvStep]
    stop: list[str]

    def __call__(self, messages: list[dict[str, Any]], columns: dict[str, Any]) -> EnvStep:
        """One step, its result checked: an EnvStep with role/content messages and a finite reward."""
        result = self.step(messages, **columns)
        if not isinstance(result, EnvStep):
            raise EnvironmentSpecError(f"environment {self.name!r} returned a {type(result).__name__}; return an "
                                    "EnvStep(messages, done, reward)")
        for m in result.messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise EnvironmentSpecError(f"environment {self.name!r} returned the message {m!r}; each is "
                                        "{'role': str, 'content': str}")
        if result.reward is not None and not (isinstance(result.reward, (int, float)) and
                                              abs(float(result.reward)) < float("inf")):
            raise EnvironmentSpecError(f"environment {self.name!r} returned reward {result.reward!r}; give a finite "
                                    "number or None")
        return result


def load_environment(spec: RewardSpec | Callable | None, where: str = "GRPO.environment") -> Environment | None:
    """An Environment from an import path, `{path, kwargs}` or a callable/object (None: single-turn GRPO).
    A class is instantiated (with the kwargs); a function is the step itself."""
    if spec is None:
        return None
    path = spec.get("path") if isinstance(spec, dict) else spec
    if isinstance(path, str) and ("/" in path or "\\" in path):
        raise EnvironmentSpecError(f"{where}={path!r} is not an import path; give 'package.module.Name', e.g. "
                                "'astrai_pl.objectives.environments.Calculator'")
    if hasattr(spec, "step") and not inspect.isclass(spec):  # an environment object, given in Python
        name, obj = type(spec).__name__, spec
    else:
        name, fn = load_reward_func(spec, where)
        obj = fn() if inspect.isclass(getattr(fn, "func", fn)) else fn
    step = getattr(obj, "step", obj)
    if not callable(step):
        raise EnvironmentSpecError(f"{where}={spec!r}: {name} has no step(messages, **columns) method")
    stop = list(getattr(obj, "stop", None) or [])
    if not all(isinstance(s, str) and s for s in stop):
        raise EnvironmentSpecError(f"{where}: {name}.stop={stop!r}; give a list of non-empty strings")
    return Environment(name, step, stop)


def environment_spec_name(spec: Any) -> Any:
    """A plain, checkpoint-safe form of an environment spec: an object given in Python becomes its class's
    import path, a callable its own."""
    if spec is None or isinstance(spec, (str, dict)):
        return spec
    if hasattr(spec, "step") and not inspect.isclass(spec):
        spec = type(spec)
    return spec_name(spec)


# -- the calculator tool on the arithmetic task ---------------------------------------------------------

_CALL = re.compile(r"<calc>([^<>]{0,64})</calc>\s*$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}
_LIMIT = 10**12  # a larger intermediate value is refused, so a call cannot take long


def calculate(expression: str) -> int:
    """The integer value of `expression` (integers, + - * // %, parentheses, unary minus); ValueError else.
    Parsed into a syntax tree and walked here: nothing is ever executed."""
    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            value = _OPS[type(node.op)](left, right)
        else:
            raise ValueError(f"unsupported {type(node).__name__}")
        if abs(value) > _LIMIT:
            raise ValueError("value too large")
        return value

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an expression: {err.msg}") from None
    return walk(tree.body)


class Calculator:
    """A calculator tool: a model turn that ends in `<calc>EXPR</calc>` is answered `<result>VALUE</result>`
    (`<result>error</result>` for an expression it cannot compute), inline; a turn without a call ends the
    episode with reward 1.0 when its last integer equals the row's `answer` (else 0.0; None without one).
    At most `max_calls` calls an episode; the next one ends it with reward 0."""

    stop = ["</calc>"]

    def __init__(self, max_calls: int = 2):
        if max_calls < 0:
            raise ValueError(f"Calculator.max_calls={max_calls}; must be >= 0")
        self.max_calls = max_calls

    def step(self, messages: Sequence[dict[str, Any]], answer: Any = None, **columns: Any) -> EnvStep:
        last = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        call = _CALL.search(last)
        if call is None:
            reward = None if answer is None else exact_match(last, answer)
            return EnvStep(done=True, reward=reward)
        calls = sum(1 for m in messages if m["role"] == "tool")
        if calls >= self.max_calls:
            return EnvStep(done=True, reward=0.0)
        try:
            value = str(calculate(call.group(1)))
        except ValueError:
            value = "error"
        return EnvStep([{"role": "tool", "content": f"<result>{value}</result>"}])
