"""The built-in post-training task: arithmetic questions from a seeded generator ("What is 37 + 48?" -> "85").

Offered as SFT conversations (about one in FOLLOW_UP_EVERY with a second question after the first
answer, so a chat model learns to answer a follow-up), DPO pairs (the right answer chosen over a near
miss; `policy_pairs` builds them from a model's own wrong samples instead) and GRPO prompts with an
`answer` column. Whether a problem is held out depends only on the problem itself (a CRC of its text),
so the `test` split never shares a problem with `train`, whatever the seed or the row count.
"""

from __future__ import annotations

import operator
import random
import re
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from datasets import Dataset

from .formats import row_format

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SPLITS = ("train", "test")
NUMBER = re.compile(r"-?\d+(?:,\d{3})*")
NEAR_MISSES = (-10, -2, -1, 1, 2, 10)
FOLLOW_UP_EVERY = 3  # about one SFT conversation in 3 asks a second question after the first answer


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> str:
        return str(OPERATORS[self.op](self.a, self.b))


def is_held_out(problem: Problem, fraction: float = 0.1) -> bool:
    """True for about `fraction` of all problems, fixed by the problem's text alone."""
    return zlib.crc32(problem.question.encode()) % 10_000 < fraction * 10_000


MAX_ENUMERATED = 1_000_000  # problems held_out_set looks through at most: about 2 s


def held_out_set(ops: Sequence[str] = ("+", "-"), max_operand: int = 99, held_out_fraction: float = 0.1
                 ) -> list[Problem]:
    """Every held-out problem with operands in [0, max_operand], each once, in a fixed order (first operand,
    operator, second operand): the exact held-out accuracy is the share of these answered right, where the
    `test` rows draw problems with repeats and so weigh some several times and others not at all. ValueError
    past MAX_ENUMERATED problems to look through (max_operand 706 with two operators)."""
    size = len(ops) * (max_operand + 1) ** 2
    if size > MAX_ENUMERATED:
        raise ValueError(f"held_out_set: {len(ops)} x {max_operand + 1:,}^2 = {size:,} problems to look through, over "
                         f"{MAX_ENUMERATED:,}; lower max_operand, or score a sample: problems(n, 'test', …)")
    return [p for a in range(max_operand + 1) for op in ops for b in range(max_operand + 1)
            if is_held_out(p := Problem(a, op, b), held_out_fraction)]


def train_position(problem: Problem) -> float:
    """Where `problem` falls in [0, 1), by a hash of its text other than `is_held_out`'s: `train_range` keeps the
    training problems whose position lies in it, so two ranges that do not overlap share no problem."""
    return (zlib.crc32(b"train:" + problem.question.encode()) % 10_000) / 10_000


def problems(
    n: int,
    split: str = "train",
    seed: int = 0,
    ops: Sequence[str] = ("+", "-"),
    max_operand: int = 99,
    held_out_fraction: float = 0.1,
    train_range: Sequence[float] = (0.0, 1.0),
) -> list[Problem]:
    """`n` problems (repeats possible) with operands in [0, max_operand], all of `split` (train or test); of
    the training problems only those whose `train_position` lies in [train_range[0], train_range[1])."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; use one of {SPLITS}")
    unknown = [op for op in ops if op not in OPERATORS]
    if unknown or not ops:
        raise ValueError(f"ops={list(ops)}; use a non-empty subset of {sorted(OPERATORS)}")
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction={held_out_fraction}; must lie in (0, 1)")
    check_train_range(train_range)
    rng = random.Random(f"{seed}:{split}")
    return list(islice(draw(rng, split, ops, max_operand, held_out_fraction, train_range), n))


def check_train_range(train_range: Sequence[float]) -> None:
    if not (len(train_range) == 2 and 0.0 <= train_range[0] < train_range[1] <= 1.0):
        raise ValueError(f"train_range={list(train_range)}; give [low, high] with 0 <= low < high <= 1")


MAX_MISSES = 100_000  # draws in a row outside the split before it is taken to be empty


def draw(rng: random.Random, split: str, ops: Sequence[str], max_operand: int, held_out_fraction: float,
         train_range: Sequence[float] = (0.0, 1.0)) -> Iterator[Problem]:
    """Problems of `split` from `rng`, without end. ValueError when MAX_MISSES draws in a row fall outside the
    split (options that leave it empty, e.g. a train_range too narrow for a few operands)."""
    low, high = train_range
    misses = 0
    while True:
        p = Problem(rng.randint(0, max_operand), rng.choice(list(ops)), rng.randint(0, max_operand))
        held_out = is_held_out(p, held_out_fraction)
        if held_out if split == "test" else not held_out and low <= train_position(p) < high:
            misses = 0
            yield p
        else:
            misses += 1
            if misses == MAX_MISSES:
                raise ValueError(f"no {split} problem in {MAX_MISSES:,} draws with max_operand={max_operand}, "
                                 f"held_out_fraction={held_out_fraction}, train_range={list(train_range)}: the split "
                                 "is empty or nearly so; widen train_range or held_out_fraction, or raise max_operand")


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A near miss: the right answer plus a small nonzero offset."""
    return str(int(problem.answer) + rng.choice(NEAR_MISSES))


def generate_rows(kind: str, n: int, split: str = "train", seed: int = 0, **options) -> Iterator[dict]:
    """Rows of one kind: sft {messages}, dpo {prompt, chosen, rejected} (as messages), grpo {prompt, answer}.

    An sft row is a conversation of one question, or (one in about FOLLOW_UP_EVERY) of two: a follow-up
    question of the same split, and its answer, after the first answer."""
    arithmetic_row = row_format(kind).arithmetic_row
    rng = random.Random(f"{seed}:{split}:wrong")  # apart from the problems' generator: rows of every kind agree
    turns = random.Random(f"{seed}:{split}:follow-up")  # likewise: the first question of row i is the same
    follow_ups = draw(turns, split, options.get("ops", ("+", "-")), options.get("max_operand", 99),
                      options.get("held_out_fraction", 0.1), options.get("train_range", (0.0, 1.0)))
    for p in problems(n, split, seed, **options):
        row = arithmetic_row(p.question, p.answer, wrong_answer(p, rng))
        if kind == "sft" and turns.randrange(FOLLOW_UP_EVERY) == 0:
            row = follow_up(row, next(follow_ups))
        yield row


def follow_up(row: dict[str, Any], problem: Problem) -> dict[str, Any]:
    """A conversation row with `problem` asked and answered after its last turn."""
    return {**row, "messages": [*row["messages"], {"role": "user", "content": problem.question},
                                {"role": "assistant", "content": problem.answer}]}


def policy_pairs(problems: Sequence[Problem], samples: Sequence[Sequence[str]], per_problem: int = 2
                 ) -> list[dict[str, Any]]:
    """DPO rows from a model's own answers (on-policy pairs): for each problem, the right answer chosen over
    each of its sampled answers that is wrong (by `exact_match`), most frequent first, at most `per_problem`;
    a problem the model never got wrong gives no row. `samples[i]` are the answers sampled for `problems[i]`.

    Rows are {prompt, chosen, rejected} as messages, as `generate_rows("dpo", …)` writes them."""
    if len(problems) != len(samples):
        raise ValueError(f"{len(samples)} lists of samples for {len(problems)} problems")
    pair = row_format("dpo").arithmetic_row
    rows = []
    for problem, answers in zip(problems, samples):
        wrong = Counter(a.strip() for a in answers if not exact_match(a, problem.answer))
        rows += [pair(problem.question, problem.answer, a) for a, _ in wrong.most_common(per_problem)]
    return rows


def synthetic_dataset(
    kind: str, n: int, split: str = "train", seed: int = 0, cache_dir: str | None = None, **options
) -> Dataset:
    """`generate_rows` as a 🤗 Dataset; file-backed and cached by its arguments, so maps over it cache too."""
    # lists in gen_kwargs would be split into shards by `datasets`; tuples are passed whole
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    kwargs = dict(kind=kind, n=n, split=split, seed=seed, **options)
    return Dataset.from_generator(generate_rows, gen_kwargs=kwargs, cache_dir=cache_dir)


def extract_answer(text: str) -> str | None:
    """The last integer in `text` (thousands separators removed), or None."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def exact_match(prediction: str, answer: str | int) -> float:
    """1.0 when the last integer of `prediction` equals `answer`, else 0.0."""
    return float(extract_answer(prediction) == str(answer).strip())


def accuracy(predictions: Sequence[str], answers: Sequence[str | int]) -> float:
    """Mean exact match."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} answers")
    return sum(map(exact_match, predictions, answers)) / max(1, len(answers))
