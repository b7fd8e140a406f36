"""`make demo`: the main job on the embedded defaults, end to end on a CPU.

Each stage runs one shipped config exactly as `astrai-pl fit --config …` does and starts from the
checkpoint the stage before it wrote:

1. pretrain (`configs/pretrain/tiny.yaml`): the `tiny` preset on the CPython documentation; prints the
   held-out loss before and after.
2. sft (`configs/sft/tiny.yaml`, 400 of its 800 steps): the built-in arithmetic task, 80% of its training
   problems; prints the exact-match accuracy of greedy answers to every held-out problem once (never seen in
   any stage; the 48 of lm-eval's astrai_arithmetic_small, so both tables agree) before and after.
3. dpo (`configs/dpo/tiny.yaml`): on-policy preference pairs on every training problem: the SFT model answers
   each of them 16 times (temperature 1, the engine), and each wrong answer it gave is paired, as rejected,
   with the right one, chosen (written to the run's `pairs.jsonl`, passed as `--data.init_args.path`); prints
   rewards/accuracies as training goes and the held-out accuracy next to SFT's.
4. grpo (`configs/grpo/tiny.yaml`, 200 steps at lr 5e-5), on every training problem: groups of answers sampled
   by the engine from the model being trained, scored by exact match plus partial credit for a near answer (so
   a group whose answers are all wrong, but not equally wrong, still teaches); prints the mean exact-match
   reward on validation prompts before and after (same random draws), the held-out accuracy next to DPO's, and
   its reward on the held-out problems (32 answers sampled to each, the same random draws before and after).
5. generate: `astrai-pl generate` on the GRPO checkpoint over the held-out problems, scored again.

Every stage checks its own claim: pretraining and SFT stop the demo at once when theirs does not hold; DPO
must not lose more than a point of held-out accuracy, GRPO of its reward on the held-out problems (what it
optimises; its greedy answers to a few problems flip either way), and the demo names a stage that did after its
table (with `--strict` it then exits with status 1). While a stage
trains it prints a progress line (step, loss, tokens/s, ETA) at every tenth of its steps and at least every
30 s (callbacks/progress.py); after each of the four training stages, the table of lm-eval's shipped tasks on
its model (astrai_arithmetic_small with the chat template after each, astrai_next_sentence without it after
pretraining; `--no-eval` skips them); at the end, a table of every stage: its figures, time and throughput.

    python -m astrai_pl.demo                                                       # every stage
    python -m astrai_pl.demo --pretrained runs/pretrain-tiny/latest/checkpoints/last.ckpt  # from stage 2
    python -m astrai_pl.demo --sft runs/sft-tiny/latest/checkpoints/last.ckpt              # from stage 3
    python -m astrai_pl.demo --dpo runs/dpo-tiny/latest/checkpoints/last.ckpt              # from stage 4
    python -m astrai_pl.demo --seed 2    # every stage's seed_everything (the configs' 1234 without it)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from .callbacks.progress import ProgressLines
from .cli import lightning_main
from .commands import generate_verb
from .data.synthetic import Problem, accuracy, exact_match, policy_pairs
from .inference import Engine, SamplingParams
from .objectives import greedy_accuracy
from .objectives.evaluation import chat_prompts
from .objectives.rollout import pool_tokens
from .sweep import text_table

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PROGRESS_METRICS = {"pretrain": ["train/loss"], "sft": ["train/loss"], "dpo": ["train/loss", "train/rewards/accuracies"],
                    "grpo": ["train/loss", "train/reward"]}
# (task, chat template, documents: None for all) after each stage. astrai_arithmetic_small's 48 answers take ~2 s
# of CPU; astrai_next_sentence's 4 x 110 choices ~65 s on the tiny model, so it runs once, on the first 55
# questions, where it measures what the stage taught: after pretraining.
ARITHMETIC = ("astrai_arithmetic_small", True, None)
# What the demo sets beside each stage's config (printed with the stage's command). SFT stops at 400 of its
# config's 800 steps, on 80% of the training problems (Arithmetic.train_range), and leaves the model still
# learning: the later stages teach from what it gets wrong, on every training problem. When SFT had fitted its
# problems (800 steps, train loss 0.05), DPO and GRPO had nothing left to teach and moved the held-out answers by
# a few problems either way (eight runs: each lost 2 to 6 points in two of them). From the 400-step model, DPO's
# pairs from its own mistakes on all 402 problems (about 1,000 to 1,300) raised held-out accuracy in seven runs of
# eight and left it unchanged in one. GRPO then runs 200 steps at lr 5e-5, which raised its exact-match reward on
# the held-out problems in all eight; 80 steps at its config's 2e-5 barely moved the policy (validation reward
# -0.01 to +0.03), and 40 steps at 1e-4 and above lost 4 to 18 of the 48 held-out problems in a seed
# (docs/getting-started.md#across-seeds).
STAGE_OVERRIDES = {"sft": ["--data.init_args.synthetic.train_range", "[0.0, 0.8]", "--trainer.max_steps", "400",
                           "--trainer.val_check_interval", "400"],
                   "dpo": ["--data.init_args.synthetic.train_range", "[0.0, 1.0]",
                           "--model.init_args.optimizer.init_args.lr", "3e-5"],
                   "grpo": ["--data.init_args.synthetic.train_range", "[0.0, 1.0]", "--trainer.max_steps", "200",
                            "--model.init_args.optimizer.init_args.lr", "5e-5"]}
POLICY_SAMPLES = 16  # answers the SFT model gives to each of its problems, for the DPO stage's pairs
PAIRS_PER_PROBLEM = 4  # at most this many of a problem's wrong answers (the most frequent) become pairs
# passes of the DPO stage over its pairs: their number depends on the SFT model's mistakes (1,032 to 1,316 in
# eight runs), and a fixed number of steps would be a different number of passes in each run
DPO_EPOCHS = 3
EXACT_MATCH = "rewards/exact_match_reward/mean"  # GRPO's rollout metric of the exact-match reward
HELD_OUT_SAMPLES = 32  # GRPO's reward on the held-out problems: answers sampled to each (48 x 32 = 1,536)
EVALUATIONS = {"pretrain": (("astrai_next_sentence", False, 55), ARITHMETIC), "sft": (ARITHMETIC,),
               "dpo": (ARITHMETIC,), "grpo": (ARITHMETIC,)}


@dataclass
class StageRecord:
    """What one stage did, for the table at the end."""

    stage: str
    held_out: str  # the held-out figure before -> after, e.g. "loss 5.686 -> 2.028" or "accuracy 83.5% -> 87.0%"
    result: str  # the stage's other figures, e.g. "rollout reward 0.755 -> 0.790"
    seconds: float  # wall-clock, set-up and the stage's own checks included, lm-eval's evaluation not
    steps: int | None = None
    tokens_per_sec: float | None = None
    eval_seconds: float | None = None
    evaluation: list[list[Any]] = field(default_factory=list)  # evaluation_rows


def evaluation_rows(results: dict[str, Any]) -> list[list[Any]]:
    """lm-eval's results as rows of (task, metric, value, stderr, documents); a filter other than "none" is
    named after the metric, stderr is "n/a" where lm-eval gives none (or "N/A")."""
    rows = []
    for task, values in results.get("results", {}).items():
        documents = results.get("n-samples", {}).get(task, {}).get("effective", "n/a")
        for key, value in values.items():
            metric, comma, filtered = key.partition(",")
            if not comma or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # a metric is "name,filter"; sample_len and alias are not metrics
            stderr = values.get(f"{metric}_stderr,{filtered}")
            name = metric if filtered in ("", "none") else f"{metric} ({filtered})"
            rows.append([task, name, float(value), float(stderr) if isinstance(stderr, (int, float)) else "n/a",
                         documents])
    return rows


def evaluation_table(rows: list[list[Any]]) -> str:
    return text_table(["task", "metric", "value", "stderr", "documents"], rows)


def stage_table(records: list[StageRecord]) -> str:
    """One row per stage: its held-out figure first, then its time, steps, tokens/s and evaluation time, a column
    per evaluated metric (named without its filter; a blank where the stage was not evaluated), and its other
    figures last."""
    metrics = list(dict.fromkeys((task, metric) for r in records for task, metric, *_ in r.evaluation))
    header = ["stage", "held-out", "time (s)", "steps", "tokens/s", "eval (s)",
              *(f"{task.removeprefix('astrai_')} {metric.partition(' (')[0]}" for task, metric in metrics), "result"]
    rows = []
    for r in records:
        values = {(task, metric): value for task, metric, value, *_ in r.evaluation}
        rows.append([r.stage, r.held_out, round(r.seconds), "" if r.steps is None else r.steps,
                     "" if r.tokens_per_sec is None else round(r.tokens_per_sec),
                     "" if r.eval_seconds is None else round(r.eval_seconds),
                     *(values.get(m, "") for m in metrics), r.result])
    return text_table(header, rows)


def evaluate_stage(record: StageRecord, module, enabled: bool) -> None:
    """The stage's lm-eval tasks (EVALUATIONS) on its model as it is now, through the Evaluate callback's own
    evaluation; prints the table and keeps its rows and time in `record`."""
    if not enabled:
        return
    try:
        from .callbacks.evaluate import Evaluate
    except ImportError as err:  # lm-eval is the `eval` extra (`dev` has it too)
        print(f"{record.stage}: evaluation skipped ({err}); pip install 'astrai-pl[eval]' for it", flush=True)
        return
    t0 = time.perf_counter()
    for task, chat, limit in EVALUATIONS.get(record.stage, ()):
        results = Evaluate([task], limit=limit, apply_chat_template=chat, log_samples=False).evaluate(module)
        record.evaluation += evaluation_rows(results)
    record.eval_seconds = time.perf_counter() - t0
    print(f"{record.stage}: evaluation of its model in {record.eval_seconds:.0f} s\n"
          f"{evaluation_table(record.evaluation)}", flush=True)


def training_record(stage: str, cli, held_out: str, result: str, started: float) -> StageRecord:
    """The StageRecord of a stage whose trainer ran `fit` with a ProgressLines callback."""
    progress = next((c for c in cli.trainer.callbacks if isinstance(c, ProgressLines)), None)
    summary = progress.summary if progress is not None else None
    return StageRecord(stage, held_out, result, time.perf_counter() - started, cli.trainer.global_step,
                       summary.tokens_per_sec if summary is not None else None)


def held_out_loss(cli) -> float:
    (metrics,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return float(metrics["val/loss"])


def stage_cli(stage: str, quiet: list[str], init_from: Path | None = None):
    """The objective, data and trainer of configs/<stage>/tiny.yaml, unrun; prints the equivalent command."""
    config = CONFIGS / stage / "tiny.yaml"
    overrides = ([] if init_from is None else ["--model.init_args.init_from", str(init_from)]) + quiet
    overrides += STAGE_OVERRIDES.get(stage, [])
    print(f"== {stage}: astrai-pl fit --config {config.relative_to(CONFIGS.parent)} {' '.join(overrides)}",
          flush=True)
    cli = lightning_main(["--config", str(config), *overrides], run=False)
    cli.trainer.callbacks.append(ProgressLines(name=stage, metrics=PROGRESS_METRICS.get(stage)))  # prints only
    return cli


def pretrain_stage(quiet: list[str], records: list[StageRecord], evaluate: bool = True) -> Path:
    started = time.perf_counter()
    cli = stage_cli("pretrain", quiet)
    start = held_out_loss(cli)
    t0 = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seconds = time.perf_counter() - t0
    end = held_out_loss(cli)
    print(f"pretrain: held-out loss {start:.3f} -> {end:.3f} (ppl {torch.exp(torch.tensor(start)):.1f} -> "
          f"{torch.exp(torch.tensor(end)):.1f}) after {cli.trainer.global_step} steps in {seconds:.0f} s",
          flush=True)
    if not end < start - 1.0:
        raise SystemExit("pretrain: the held-out loss did not fall clearly; something is wrong")
    records.append(training_record("pretrain", cli, f"loss {start:.3f} -> {end:.3f}",
                                   f"ppl {torch.exp(torch.tensor(start)):.1f} -> {torch.exp(torch.tensor(end)):.1f}",
                                   started))
    evaluate_stage(records[-1], cli.model, evaluate)
    return Path(cli.trainer.checkpoint_callback.last_model_path)


def sft_stage(quiet: list[str], pretrained: Path, records: list[StageRecord], evaluate: bool = True) -> Path:
    started = time.perf_counter()
    cli = stage_cli("sft", quiet, pretrained)
    data, model = cli.datamodule, cli.model
    problems = data.synthetic.held_out_set()
    t0 = time.perf_counter()
    before = greedy_accuracy(model.model, data.tokenizer, problems)
    cli.trainer.fit(model, datamodule=data)
    after = greedy_accuracy(model.model, data.tokenizer, problems)
    seconds = time.perf_counter() - t0
    print(f"sft: held-out exact-match accuracy {before:.1%} -> {after:.1%} on {len(problems)} problems never "
          f"seen in training, after {cli.trainer.global_step} steps; {seconds:.0f} s with evaluation", flush=True)
    if not after > before + 0.1:
        raise SystemExit("sft: held-out accuracy did not rise clearly; something is wrong")
    records.append(training_record("sft", cli, f"accuracy {before:.1%} -> {after:.1%}",
                                   f"{len(problems)} held-out problems", started))
    evaluate_stage(records[-1], model, evaluate)
    return Path(cli.trainer.checkpoint_callback.last_model_path)


def stage_failure(stage: str, before: float, after: float, own_claim: str, own_holds: bool,
                  tolerance: float = 0.01, measure: str = "held-out accuracy") -> str | None:
    """Why a post-training stage failed, or None: it fails when it loses more than `tolerance` of its held-out
    `measure` (GRPO's is its reward on the held-out problems). Prints whether the measure rose and whether the
    stage's own claim (`own_claim`, e.g. its validation reward rose) held: whether a stage helps is a matter of
    the average over seeds (one of the 48 problems more or less moves the accuracy by 2.1 points), a fall beyond
    a point is a failure in any one run."""
    change = "rose" if after > before else "unchanged" if after == before else f"fell by {before - after:.1%}"
    failed = after < before - tolerance
    print(f"{stage}: {measure} {before:.1%} -> {after:.1%} ({change}); {own_claim}: "
          f"{'yes' if own_holds else 'no'}; within a point of where it started or above: {'NO' if failed else 'yes'}",
          flush=True)
    return f"{stage}: {measure} fell by {before - after:.1%} ({before:.1%} -> {after:.1%})" if failed else None


def logged(cli, name: str) -> list[float]:
    """The values of metric `name` in the run's CSV log (metrics.csv), in the order they were logged."""
    with (Path(cli.trainer.logger.log_dir) / "metrics.csv").open() as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def sampled_answers(model, tokenizer, problems: list[Problem], n: int, seed: int) -> list[list[str]]:
    """`n` answers of `model` to each problem, sampled by the engine at temperature 1 (as the chat template asks
    them), each answer with its own seed."""
    prompts = chat_prompts([p.question for p in problems], tokenizer)
    params = [SamplingParams(max_tokens=8, temperature=1.0, n=n, seed=seed + i * n) for i in range(len(prompts))]
    was_training = model.training
    model.eval()
    try:
        engine = Engine(model, tokenizer, page_size=16, max_total_tokens=pool_tokens(prompts, n, 8, 16))
        completions = engine.generate(prompts, params)
    finally:
        model.train(was_training)
    texts = [c.text for c in completions]  # grouped by prompt, n each
    return [texts[i * n:(i + 1) * n] for i in range(len(problems))]


def held_out_reward(model, tokenizer, problems: list[Problem], samples: int = HELD_OUT_SAMPLES,
                    seed: int = 0) -> float:
    """GRPO's exact-match reward on the held-out problems: the share of right answers among `samples` sampled
    answers to each (temperature 1, as GRPO samples them), each problem's answers drawn with fixed seeds, so
    two calls on two models draw the same random numbers and their difference is the models'."""
    answers = sampled_answers(model, tokenizer, problems, samples, seed)
    return fmean(exact_match(a, p.answer) for p, group in zip(problems, answers) for a in group)


def write_policy_pairs(cli, samples: int, seed: int, epochs: int) -> Path:
    """On-policy pairs for the DPO stage: the model it starts from (SFT's) answers every distinct training
    problem `samples` times; each wrong answer is paired with the right one (`policy_pairs`). Writes them to
    the run's pairs.jsonl, points the data module at that file and sets the trainer's max_steps to `epochs`
    passes over them."""
    data, t0 = cli.datamodule, time.perf_counter()
    train = sorted(set(data.synthetic.problems("train", data.hparams.seed)), key=lambda p: p.question)
    answers = sampled_answers(cli.model.model, data.tokenizer, train, samples, seed)
    rows = policy_pairs(train, answers, PAIRS_PER_PROBLEM)
    if len(rows) < data.hparams.batch_size:
        raise SystemExit(f"dpo: the SFT model got only {len(rows)} of {samples * len(train)} sampled answers wrong: "
                         "too few pairs to learn from")
    path = Path(cli.trainer.logger.log_dir) / "pairs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    wrong = sum(not exact_match(a, p.answer) for p, group in zip(train, answers) for a in group)
    steps = math.ceil(epochs * len(rows) / data.hparams.batch_size)
    print(f"dpo: {len(rows)} on-policy pairs in {path}: the SFT model answered {len(train)} training problems "
          f"{samples} times each, {wrong / (samples * len(train)):.1%} of the answers wrong; {time.perf_counter() - t0:.0f} s."
          f" Training for {epochs} passes over them: --data.init_args.path {path} --trainer.max_steps {steps}",
          flush=True)
    data.hparams.path = str(path)
    cli.trainer.fit_loop.epoch_loop.max_steps = steps
    return path


def dpo_stage(quiet: list[str], sft: Path, records: list[StageRecord], failures: list[str], evaluate: bool = True,
              seed: int = 1234) -> tuple[Path, float]:
    started = time.perf_counter()
    cli = stage_cli("dpo", quiet, sft)
    data, model = cli.datamodule, cli.model
    problems = data.synthetic.held_out_set()
    write_policy_pairs(cli, POLICY_SAMPLES, seed, DPO_EPOCHS)
    t0 = time.perf_counter()
    before = greedy_accuracy(model.model, data.tokenizer, problems)  # the SFT model, which DPO starts from
    (start,) = cli.trainer.validate(model, datamodule=data, verbose=False)  # policy = reference: all rewards 0
    cli.trainer.fit(model, datamodule=data)
    after = greedy_accuracy(model.model, data.tokenizer, problems)
    seconds = time.perf_counter() - t0
    accuracies = logged(cli, "train/rewards/accuracies")
    (end_metrics,) = cli.trainer.validate(model, datamodule=data, verbose=False)
    end = float(end_metrics["val/rewards/accuracies"])
    in_training = (f"; in training {accuracies[0]:.2f} at the first logged step -> {accuracies[-1]:.2f} at the last "
                   f"(mean of the last {len(accuracies) - len(accuracies) // 2} logged: "
                   f"{fmean(accuracies[len(accuracies) // 2:]):.2f})") if accuracies else ""
    print(f"dpo: rewards/accuracies on validation pairs {start['val/rewards/accuracies']:.2f} -> {end:.2f}{in_training}",
          flush=True)
    print(f"dpo: held-out exact-match accuracy {before:.1%} after SFT -> {after:.1%} after DPO on "
          f"{len(problems)} problems, after {cli.trainer.global_step} steps; {seconds:.0f} s with evaluation",
          flush=True)
    failure = stage_failure("dpo", before, after, "rewards/accuracies on validation pairs above 0.5", end > 0.5)
    failures += [failure] if failure else []
    records.append(training_record("dpo", cli, f"accuracy {before:.1%} -> {after:.1%}", f"rewards/accuracies "
                                   f"{start['val/rewards/accuracies']:.2f} -> {end:.2f}", started))
    evaluate_stage(records[-1], model, evaluate)
    return Path(cli.trainer.checkpoint_callback.last_model_path), after


def paired_reward(model, batches: list[dict]) -> float:
    """Mean exact-match reward of num_generations sampled completions per prompt of `batches` (the total reward
    where the objective has no exact_match_reward), each sample with its own fixed seed: called before and
    after training, both calls draw the same random numbers, so the difference is the policy's and not the
    luck of the draw."""
    metrics = [model.roll_out(batch, seed=10_000 * i).metrics for i, batch in enumerate(batches)]
    return fmean(m.get(EXACT_MATCH, m["reward"]) for m in metrics)


def grpo_stage(quiet: list[str], dpo: Path, dpo_accuracy: float | None, records: list[StageRecord],
               failures: list[str], evaluate: bool = True) -> tuple[Path, float, list[Problem]]:
    started = time.perf_counter()
    cli = stage_cli("grpo", quiet, dpo)
    data, model = cli.datamodule, cli.model
    problems = data.synthetic.held_out_set()
    before = greedy_accuracy(model.model, data.tokenizer, problems) if dpo_accuracy is None else dpo_accuracy
    held_out_before = held_out_reward(model.model, data.tokenizer, problems)
    data.setup("validate")
    prompts = list(islice(data.val_dataloader(), max(1, 64 // data.hparams.batch_size)))  # 64 validation prompts
    reward_before = paired_reward(model, prompts)
    t0 = time.perf_counter()
    cli.trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - t0
    reward_after = paired_reward(model, prompts)
    held_out_after = held_out_reward(model.model, data.tokenizer, problems)
    after = greedy_accuracy(model.model, data.tokenizer, problems)
    rewards = model.reward_history  # the mean reward of each training rollout, in order
    window = max(1, len(rewards) // 5)
    print(f"grpo: mean rollout reward (exact match and partial credit) {fmean(rewards[:window]):.3f} -> "
          f"{fmean(rewards[-window:]):.3f} over training (first and last {window} of {len(rewards)} rollouts, each "
          f"on new prompts); exact-match reward {reward_before:.3f} -> {reward_after:.3f} on "
          f"{sum(len(b['prompt_ids']) for b in prompts)} validation prompts with the same random draws; "
          f"{cli.trainer.global_step} steps in {seconds:.0f} s", flush=True)
    print(f"grpo: held-out exact-match accuracy {before:.1%} after DPO -> {after:.1%} after GRPO on "
          f"{len(problems)} problems (greedy answers); its reward there, {HELD_OUT_SAMPLES} answers sampled to each "
          f"with the same random draws: {held_out_before:.1%} -> {held_out_after:.1%}", flush=True)
    failure = stage_failure("grpo", held_out_before, held_out_after, "the exact-match reward on validation prompts "
                            "rose", reward_after > reward_before, measure="held-out reward")
    failures += [failure] if failure else []
    records.append(training_record("grpo", cli, f"accuracy {before:.1%} -> {after:.1%}, reward {held_out_before:.1%}"
                                   f" -> {held_out_after:.1%}", f"validation reward {reward_before:.3f} -> "
                                   f"{reward_after:.3f}", started))
    evaluate_stage(records[-1], model, evaluate)
    return Path(cli.trainer.checkpoint_callback.last_model_path), after, problems


def generate_stage(ckpt: Path, problems: list[Problem], expected: float | None, records: list[StageRecord]) -> None:
    """`astrai-pl generate` over the held-out problems (greedy, one JSONL line each), scored by exact match."""
    folder = ckpt.parent.parent / "held-out"
    folder.mkdir(parents=True, exist_ok=True)
    prompts, completions = folder / "prompts.jsonl", folder / "completions.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.question, "answer": p.answer}) + "\n" for p in problems))
    argv = ["--model", str(ckpt), "--input", str(prompts), "--output", str(completions), "--chat-template",
            "--temperature", "0", "--max-tokens", "8"]
    print(f"== generate: astrai-pl generate {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    generate_verb(argv)
    rows = [json.loads(line) for line in completions.read_text().splitlines()]
    score = accuracy([r["completion"] for r in rows], [r["answer"] for r in rows])
    print(f"generate: held-out exact-match accuracy {score:.1%} on {len(rows)} problems in "
          f"{time.perf_counter() - t0:.0f} s; first answer: {rows[0]['prompt']!r} -> {rows[0]['completion']!r}",
          flush=True)
    if expected is not None and score != expected:
        raise SystemExit(f"generate: {score:.1%} differs from the evaluation loop's {expected:.1%}; the engine's "
                         "greedy answers should equal it")
    records.append(StageRecord("generate", f"accuracy {score:.1%}", f"{len(rows)} problems, astrai-pl generate",
                               time.perf_counter() - t0))


def demo_threads() -> int:
    """Intra-op threads: OMP_NUM_THREADS (the Makefile exports 2), never more than the cores this process may
    run on (its affinity mask, which `taskset` narrows; os.cpu_count() counts every core of the machine): a
    second thread on one core only waits for the first at every parallel region."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    requested = os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
    return min(int(requested), cores) if requested.isdigit() and int(requested) > 0 else cores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m astrai_pl.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--pretrained", type=Path, default=None,
                        help="a pretraining checkpoint to start stage 2 from (stage 1 is skipped)")
    parser.add_argument("--sft", type=Path, default=None,
                        help="an SFT checkpoint to start stage 3 from (stages 1 and 2 are skipped)")
    parser.add_argument("--dpo", type=Path, default=None,
                        help="a DPO checkpoint to start stage 4 from (stages 1 to 3 are skipped)")
    parser.add_argument("--no-eval", action="store_true",
                        help="skip the lm-eval tables after each stage (astrai_arithmetic_small, astrai_next_sentence)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed_everything of every stage (default: each config's, 1234); the held-out problems "
                             "stay the same")
    parser.add_argument("--stop-after", choices=("sft", "dpo"), default=None,
                        help="end after this stage (with its checks and the table)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when DPO or GRPO lost more than a point of held-out accuracy "
                             "(without it the demo says so and exits 0)")
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # consumed: the stages pass their own arguments to LightningCLI
    os.environ.setdefault("TQDM_DISABLE", "1")  # the stages print progress lines; lm-eval's bars would repeat them
    torch.set_num_threads(demo_threads())
    seed = ["--seed_everything", str(args.seed)] if args.seed is not None else []
    quiet = [*seed, "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    t0, records, failures, evaluate = time.perf_counter(), [], [], not args.no_eval
    last = run_stages(args, quiet, records, failures, evaluate)
    print(f"== the stages\n{stage_table(records)}")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s ({torch.get_num_threads()} threads); last checkpoint: "
          f"{last}")
    report_failures(failures, args.strict)


def report_failures(failures: list[str], strict: bool) -> None:
    """Name the post-training stages that lost more than a point of held-out accuracy; with `strict`, as the
    demo's exit message (status 1)."""
    if not failures:
        return
    message = "post-training stages that lost more than a point of held-out accuracy:\n  " + "\n  ".join(failures)
    if strict:
        raise SystemExit(message)
    print(f"{message}\n(held-out accuracy on this task moves by several points under small updates: "
          "docs/getting-started.md#across-seeds; --strict makes this exit with status 1)", flush=True)


def run_stages(args, quiet: list[str], records: list[StageRecord], failures: list[str], evaluate: bool) -> Path:
    """The stages from the one `args` start at to the one they stop after; the last checkpoint written."""
    dpo, dpo_accuracy = args.dpo, None
    if dpo is None:
        sft = args.sft or sft_stage(quiet, args.pretrained or pretrain_stage(quiet, records, evaluate), records,
                                    evaluate)
        if args.stop_after == "sft":
            return sft
        dpo, dpo_accuracy = dpo_stage(quiet, sft, records, failures, evaluate,
                                      1234 if args.seed is None else args.seed)
        if args.stop_after == "dpo":
            return dpo
    grpo, grpo_accuracy, problems = grpo_stage(quiet, dpo, dpo_accuracy, records, failures, evaluate)
    generate_stage(grpo, problems, grpo_accuracy, records)
    return grpo


if __name__ == "__main__":
    main()
