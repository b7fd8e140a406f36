"""`astrai-pl sweep`: run a W&B sweep file (configs/sweeps/*.yaml) here, without a W&B server.

A sweep file is in W&B's own format, so `wandb sweep FILE` then `wandb agent ID` run it as well. Its
`command` runs `astrai-pl fit --config …` and ends with `${args}`, which an agent expands to one
`--key=value` per parameter (`--model.init_args.beta=0.1`): the parameters are dotted config keys, read by
LightningCLI like any other override. This module builds the same commands for every point of a grid, or
for `--count` random points, and runs them one after another, each in its own process. At the end it prints
a table of every point: its values, whether its run succeeded, and its objective (the sweep's `metric`, the
last value the run's CSV log holds; the best is marked).

    astrai-pl sweep configs/sweeps/sft-debug.yaml                      # every point of the grid
    astrai-pl sweep configs/sweeps/dpo-tiny.yaml --count 8 --seed 0    # 8 random points
    astrai-pl sweep configs/sweeps/sft-debug.yaml --dry-run            # print the commands only

Runs are grouped in W&B by the sweep file's name ($WANDB_RUN_GROUP) and named `<group>-<n>` ($WANDB_NAME).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

METHODS = ("grid", "random")
DISTRIBUTIONS = ("constant", "categorical", "uniform", "int_uniform", "log_uniform_values", "normal")
MACROS = ("${env}", "${interpreter}", "${program}", "${args}")


class SweepError(ValueError):
    """A sweep file this runner cannot run, or a point it cannot draw."""


# -- the sweep file ----------------------------------------------------------------------------------------
def load_sweep(path: str | Path) -> dict[str, Any]:
    """The sweep file, checked: method grid or random, parameters, and a command that passes `${args}`."""
    sweep = yaml.safe_load(Path(path).read_text())
    if not isinstance(sweep, dict):
        raise SweepError(f"{path}: a sweep file is a YAML mapping with method, parameters and command")
    method = sweep.get("method")
    if method not in METHODS:
        hint = " (bayes needs W&B's sweep controller: `wandb sweep` then `wandb agent`)" if method == "bayes" else ""
        raise SweepError(f"{path}: method={method!r}; here use one of {METHODS}{hint}")
    parameters = sweep.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise SweepError(f"{path}: parameters must map dotted config keys to their values, e.g. "
                         "{model.init_args.beta: {values: [0.05, 0.1]}}")
    for name, spec in parameters.items():
        check_parameter(name, spec, method)
    command = sweep.get("command")
    if not isinstance(command, list) or "${args}" not in command:
        raise SweepError(f"{path}: command must be a list that passes ${{args}}, e.g. [${{env}}, ${{interpreter}}, "
                         "-m, astrai_pl.cli, fit, --config, configs/sft/debug.yaml, ${args}]")
    unknown = [w for w in command if str(w).startswith("${") and w not in MACROS]
    if unknown:
        raise SweepError(f"{path}: command uses {unknown[0]}; this runner knows {', '.join(MACROS)}")
    return sweep


def check_parameter(name: str, spec: Any, method: str) -> None:
    """Fail naming the parameter unless `spec` is a value, a list of values, or (random) a distribution."""
    if not isinstance(spec, dict) or not {"value", "values", "distribution", "min", "max"} & set(spec):
        raise SweepError(f"parameter {name!r}: give {{values: [...]}}, {{value: x}} or a distribution such as "
                         "{distribution: log_uniform_values, min: 1.0e-4, max: 1.0e-2}")
    if "values" in spec and (not isinstance(spec["values"], list) or not spec["values"]):
        raise SweepError(f"parameter {name!r}: values must be a non-empty list")
    if method == "grid" and not {"value", "values"} & set(spec):
        raise SweepError(f"parameter {name!r} has a distribution; method grid needs values: [...] (or value: x) "
                         "for every parameter; use method: random to draw from distributions")
    kind = distribution(spec)
    if kind not in DISTRIBUTIONS:
        raise SweepError(f"parameter {name!r}: distribution {kind!r} is not supported here; use one of "
                         f"{', '.join(DISTRIBUTIONS)}")


def distribution(spec: dict[str, Any]) -> str:
    """The spec's distribution, inferred as W&B does when not named."""
    if "distribution" in spec:
        return spec["distribution"]
    if "value" in spec:
        return "constant"
    if "values" in spec:
        return "categorical"
    ints = all(isinstance(spec.get(k), int) for k in ("min", "max"))
    return "int_uniform" if ints else "uniform"


# -- points ------------------------------------------------------------------------------------------------
def grid_points(parameters: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every combination of the parameters' values, the last parameter varying fastest."""
    choices = [spec["values"] if "values" in spec else [spec["value"]] for spec in parameters.values()]
    return [dict(zip(parameters, combo)) for combo in itertools.product(*choices)]


def _bounds(name: str, spec: dict[str, Any]) -> tuple[float, float]:
    try:
        low, high = float(spec["min"]), float(spec["max"])
    except (KeyError, TypeError, ValueError):
        raise SweepError(f"parameter {name!r}: {distribution(spec)} needs numeric min and max (write 1.0e-4, "
                         "not 1e-4, for YAML to read a number)") from None
    if not low < high or (distribution(spec) == "log_uniform_values" and low <= 0):
        raise SweepError(f"parameter {name!r}: needs min < max (and min > 0 for log_uniform_values)")
    return low, high


def random_value(name: str, spec: dict[str, Any], rng: random.Random) -> Any:
    """One draw of a parameter."""
    kind = distribution(spec)
    if kind == "constant":
        return spec["value"]
    if kind == "categorical":
        return rng.choices(spec["values"], weights=spec.get("probabilities"))[0]
    if kind == "normal":
        return rng.gauss(float(spec.get("mu", 0.0)), float(spec.get("sigma", 1.0)))
    low, high = _bounds(name, spec)
    if kind == "int_uniform":
        return rng.randint(int(low), int(high))
    if kind == "log_uniform_values":
        return math.exp(rng.uniform(math.log(low), math.log(high)))
    return rng.uniform(low, high)


def sweep_points(sweep: dict[str, Any], count: int | None, seed: int) -> list[dict[str, Any]]:
    """The points to run: the grid (its first `count` with a count), or `count` random draws."""
    parameters = sweep["parameters"]
    if sweep["method"] == "grid":
        return grid_points(parameters)[:count]
    if count is None:
        raise SweepError("a random sweep never ends by itself; give --count N")
    rng = random.Random(seed)
    return [{name: random_value(name, spec, rng) for name, spec in parameters.items()} for _ in range(count)]


# -- commands ----------------------------------------------------------------------------------------------
def agent_args(point: dict[str, Any]) -> list[str]:
    """`${args}` as a W&B agent writes it: `--name=value`, the value as Python prints it."""
    return [f"--{name}={value}" for name, value in point.items()]


def trial_command(sweep: dict[str, Any], point: dict[str, Any]) -> list[str]:
    """The sweep's command for one point, as an agent runs it: `${env}` (the agent's /usr/bin/env, which
    passes the environment on) is left out, `${interpreter}` is this Python."""
    words: list[str] = []
    for word in sweep["command"]:
        if word == "${interpreter}":
            words.append(sys.executable)
        elif word == "${program}":
            words.append(str(sweep.get("program", "")))
        elif word == "${args}":
            words += agent_args(point)
        elif word != "${env}":
            words.append(str(word))
    return words


def config_files(command: list[str]) -> list[str]:
    """The files a command passes to --config."""
    files = []
    for word, following in zip(command, [*command[1:], ""]):
        if word == "--config":
            files.append(following)
        elif word.startswith("--config="):
            files.append(word.partition("=")[2])
    return files


def check_config_files(command: list[str]) -> None:
    """The configs a command reads exist from here (sweep commands name them from the repository root)."""
    for path in config_files(command):
        if not Path(path).is_file():
            raise SweepError(f"the sweep's command reads {path}, which is not a file under {Path.cwd()}; run "
                             "astrai-pl sweep from the repository root")


def run_roots(command: list[str]) -> list[Path]:
    """Where a run of `command` writes its CSV logs: `trainer.default_root_dir` and each logger's `save_dir`,
    from its config files and from the same keys given on the command line."""
    roots: list[str] = []
    for path in config_files(command):
        trainer = (yaml.safe_load(Path(path).read_text()) or {}).get("trainer") or {}
        loggers = trainer.get("logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            if isinstance(logger, dict) and (logger.get("init_args") or {}).get("save_dir"):
                roots.append(str(logger["init_args"]["save_dir"]))
        if trainer.get("default_root_dir"):
            roots.append(str(trainer["default_root_dir"]))
    keys = ("--trainer.default_root_dir", "--trainer.logger.init_args.save_dir")
    for word, following in zip(command, [*command[1:], ""]):
        key, eq, value = word.partition("=")
        if key in keys:
            roots.append(value if eq else following)
    return list(dict.fromkeys(Path(r) for r in roots))


def objective(roots: list[Path], name: str, since: float) -> float | None:
    """The last value of metric `name` in the newest metrics.csv (a CSVLogger's) written under `roots` since
    `since` (time.time()): what W&B's summary, and so its sweep, takes as the run's value."""
    logs = [f for root in roots if root.is_dir() for f in root.rglob("metrics.csv") if f.stat().st_mtime >= since]
    if not logs:
        return None
    with max(logs, key=lambda f: f.stat().st_mtime).open(newline="") as f:
        values = [row[name] for row in csv.DictReader(f) if row.get(name)]
    return float(values[-1]) if values else None


def run_points(group: str, sweep: dict[str, Any], points: list[dict[str, Any]]) -> list[tuple[int, float | None]]:
    """Run each point's command in turn, as its own process; the exit code and objective of each."""
    outcomes = []
    name = (sweep.get("metric") or {}).get("name")
    for n, point in enumerate(points, 1):
        command = trial_command(sweep, point)
        print(f"== {group} {n}/{len(points)}: {shlex.join(command)}", flush=True)
        env = {**os.environ, "WANDB_RUN_GROUP": os.environ.get("WANDB_RUN_GROUP", group),
               "WANDB_NAME": f"{group}-{n}"}
        since = time.time() - 1  # file times are coarser than the clock on some file systems
        code = subprocess.run(command, env=env).returncode
        outcomes.append((code, objective(run_roots(command), name, since) if name else None))
    return outcomes


def text_table(header: list[str], rows: list[list[Any]]) -> str:
    """Rows as an aligned plain-text table under `header`: floats to 4 significant digits, other values as
    `str` writes them; a column of numbers (blanks and n/a aside) to the right, others to the left. The
    demo prints its tables with it too."""
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    numeric = [bool(cells) and all(is_number(r[i]) or r[i] in ("", "n/a") for r in cells) for i in range(len(header))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if right else v.ljust(w) for v, w, right in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(list(map(str, header))), line(["-" * w for w in widths]), *map(line, cells)])


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def short_name(parameter: str) -> str:
    """A parameter's dotted key without its `init_args` parts: model.optimizer.lr."""
    return ".".join(part for part in parameter.split(".") if part != "init_args")


def report(points: list[dict[str, Any]], outcomes: list[tuple[int, float | None]],
           metric: dict[str, str] | None) -> None:
    """A table of each run's values, status and objective (the best marked), and a failing exit when any
    run failed."""
    names = list(points[0]) if points else []
    name, goal = (metric or {}).get("name"), (metric or {}).get("goal", "minimize")
    scored = [v for code, v in outcomes if code == 0 and v is not None]
    best = (max if goal == "maximize" else min)(scored) if scored else None
    header = ["run", *map(short_name, names), "status"] + ([f"{name} ({goal})", "best"] if name else [])
    rows = []
    for n, (point, (code, value)) in enumerate(zip(points, outcomes), 1):
        row = [n, *(str(point[k]) for k in names), "ok" if code == 0 else f"failed ({code})"]
        if name:
            row += ["n/a" if value is None else value, "*" if code == 0 and value is not None and value == best else ""]
        rows.append(row)
    print(text_table(header, rows))
    if name:
        print(f"{name}: its last logged value in each run's CSV log (n/a: none found); the runs are in W&B too; "
              "offline runs upload with `wandb sync <default_root_dir>/version_*/wandb/offline-run-*`")
    codes = [code for code, _ in outcomes]
    if any(codes):
        raise SystemExit(f"astrai-pl sweep: {sum(c != 0 for c in codes)} of {len(codes)} runs failed")


def sweep_verb(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="astrai-pl sweep", description="Run a W&B sweep file without a W&B "
                                     "server: every point of a grid, or --count random points.")
    parser.add_argument("file", help="a sweep file in W&B's format, e.g. configs/sweeps/sft-debug.yaml")
    parser.add_argument("--count", type=int, default=None, help="points to run (required for method: random)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws")
    parser.add_argument("--dry-run", action="store_true", help="print each command instead of running it")
    ns = parser.parse_args(argv)
    if ns.count is not None and ns.count < 1:
        raise SystemExit(f"astrai-pl sweep: --count {ns.count}: must be >= 1")
    try:
        sweep = load_sweep(ns.file)
        points = sweep_points(sweep, ns.count, ns.seed)
        check_config_files(trial_command(sweep, points[0]))
    except (SweepError, FileNotFoundError, yaml.YAMLError) as err:
        raise SystemExit(f"astrai-pl sweep: {err}") from None
    if ns.dry_run:
        print("\n".join(shlex.join(trial_command(sweep, p)) for p in points))
        return
    outcomes = run_points(Path(ns.file).stem, sweep, points)
    report(points, outcomes, sweep.get("metric"))
