"""W&B sweep files: the command a W&B agent runs lands every swept value in the trained run, each shipped
sweep's parameters are config keys, and `astrai-pl sweep` runs the agent's commands without a server."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from wandb.sdk.launch.sweeps import utils as wandb_sweeps

from astrai_pl import sweep as sweeps
from astrai_pl.checkpoint.archive import read_checkpoint
from astrai_pl.cli import lightning_main, main

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = sorted((ROOT / "configs" / "sweeps").glob("*.yaml"))


def agent_command(sweep: dict, point: dict) -> list[str]:
    """What a W&B agent runs for `point`, built with W&B's own helpers as its Agent._command_run does."""
    command = wandb_sweeps.create_sweep_command(list(sweep["command"]))
    macros = wandb_sweeps.create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})
    macros.update(interpreter=["python"], program=[sweep.get("program")], env=["/usr/bin/env"])
    words = []
    for word in map(str, command):
        words += (macros.get(word[2:-1]) or []) if word.startswith("${") and word.endswith("}") else [word]
    return words


def value_at(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


@pytest.mark.slow
def test_the_agents_command_lands_each_value_in_the_trained_run(tmp_path):
    sweep = yaml.safe_load((ROOT / "configs" / "sweeps" / "sft-debug.yaml").read_text())
    point = {name: spec["values"][-1] for name, spec in sweep["parameters"].items()}
    base = yaml.safe_load((ROOT / "configs" / "sft" / "debug.yaml").read_text())
    assert all(value_at(base, name) != value for name, value in point.items())  # else the check proves nothing
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the command names its config from the repository root
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    command = agent_command(sweep, point)
    assert command[:2] == ["/usr/bin/env", "python"] and "--model.init_args.label_smoothing=0.1" in command
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    ckpt = read_checkpoint(tmp_path / "runs" / "sft-debug" / "latest" / "checkpoints" / "last.ckpt")
    hparams = {"model": {"init_args": ckpt["hyper_parameters"]},
               "data": {"init_args": ckpt["datamodule_hyper_parameters"]}}
    for name, value in point.items():
        assert value_at(hparams, name) == value, name
    assert any((tmp_path / "runs" / "sft-debug" / "latest" / "wandb").glob("offline-run-*"))  # it logged to W&B


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_shipped_sweep_sets_config_keys(path, tmp_path, monkeypatch):
    sweep = sweeps.load_sweep(path)
    (point,) = sweeps.sweep_points(sweep, count=1, seed=0)
    command = sweeps.trial_command(sweep, point)
    agent = agent_command(sweep, point)
    assert command == [sys.executable, *agent[2:]]  # the agent's command, run by this Python
    args = command[command.index("fit") + 1 :]
    args[args.index("--config") + 1] = str(ROOT / args[args.index("--config") + 1])
    monkeypatch.chdir(tmp_path)
    cli = lightning_main([*args, "--model.init_args.init_from", "null"], run=False)  # parsed, not run
    for name, value in point.items():
        assert cli.config[name] == value, name


def test_the_local_runner_runs_each_point_as_the_agent_would(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(sweeps.subprocess, "run", lambda cmd, env: calls.append((cmd, env)) or
                        subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(sweeps, "objective", lambda roots, name, since: None)  # no run wrote a log
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    monkeypatch.chdir(ROOT)
    main(["sweep", "configs/sweeps/sft-debug.yaml", "--count", "3"])
    sweep = sweeps.load_sweep(ROOT / "configs" / "sweeps" / "sft-debug.yaml")
    points = sweeps.grid_points(sweep["parameters"])
    assert len(points) == 8 and [cmd for cmd, _ in calls] == [sweeps.trial_command(sweep, p) for p in points[:3]]
    assert [(env["WANDB_RUN_GROUP"], env["WANDB_NAME"]) for _, env in calls] == [
        ("sft-debug", f"sft-debug-{n}") for n in (1, 2, 3)]
    rows = capsys.readouterr().out.splitlines()[-6:-1]  # the table: header, rule, three runs
    assert rows[0].split() == ["run", "model.label_smoothing", "model.arch.num_hidden_layers", "data.batch_size",
                               "status", "val/loss", "(minimize)", "best"]
    assert rows[-1].split() == ["3", "0.0", "1", "4", "ok", "n/a"]


def fake_sweep(tmp_path: Path) -> Path:
    """A grid of four points whose command reads a config that logs under tmp_path/runs."""
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"default_root_dir": str(tmp_path / "runs"), "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path / "runs"), "name": "logs"}}}}))
    sweep = {"method": "grid", "metric": {"name": "val/loss", "goal": "minimize"},
             "parameters": {"model.init_args.optimizer.init_args.lr": {"values": [0.001, 0.01]},
                            "data.init_args.batch_size": {"values": [4, 8]}},
             "command": ["${interpreter}", "-m", "astrai_pl.cli", "fit", "--config", str(config), "${args}"]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def test_the_table_lists_each_points_values_and_the_objective_its_run_logged(tmp_path, monkeypatch, capsys):
    def fake_run(command, env):  # a run logs val/loss = lr * batch size, a row for each of two validations
        lr = float(next(w for w in command if "lr=" in w).partition("=")[2])
        batch = int(next(w for w in command if "batch_size=" in w).partition("=")[2])
        folder = tmp_path / "runs" / "logs" / f"version_{env['WANDB_NAME'][-1]}"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(f"step,train/loss,val/loss\n9,3.0,9.0\n19,2.0,\n19,,{lr * batch}\n")
        return subprocess.CompletedProcess(command, 0 if batch == 4 or lr == 0.001 else 3)

    monkeypatch.setattr(sweeps.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="1 of 4 runs failed"):
        main(["sweep", str(fake_sweep(tmp_path))])
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("run "))):]
    assert table[0].split() == ["run", "model.optimizer.lr", "data.batch_size", "status", "val/loss", "(minimize)",
                                "best"]
    assert [row.split() for row in table[2:6]] == [
        ["1", "0.001", "4", "ok", "0.004", "*"],
        ["2", "0.001", "8", "ok", "0.008"],
        ["3", "0.01", "4", "ok", "0.04"],
        ["4", "0.01", "8", "failed", "(3)", "0.08"],
    ]


def test_the_objective_comes_from_the_runs_newest_log_only(tmp_path):
    old = tmp_path / "logs" / "version_0" / "metrics.csv"
    old.parent.mkdir(parents=True)
    old.write_text("step,val/loss\n1,5.0\n")
    since = old.stat().st_mtime + 1
    os.utime(old, (since - 10, since - 10))
    assert sweeps.objective([tmp_path], "val/loss", since) is None  # an earlier run's log is not this run's
    new = tmp_path / "logs" / "version_1" / "metrics.csv"
    new.parent.mkdir()
    new.write_text("step,val/loss,train/loss\n1,4.0,\n2,,3.0\n3,3.5,\n")
    os.utime(new, (since + 1, since + 1))
    assert sweeps.objective([tmp_path], "val/loss", since) == 3.5
    assert sweeps.objective([tmp_path], "val/reward", since) is None


def test_the_runs_log_folders_come_from_its_configs_and_overrides(tmp_path):
    config = tmp_path / "fit.yaml"
    config.write_text("trainer:\n  default_root_dir: runs/a\n  logger:\n    - class_path: CSVLogger\n"
                      "      init_args: {save_dir: runs/b}\n")
    command = ["python", "-m", "astrai_pl.cli", "fit", "--config", str(config),
               "--trainer.default_root_dir=runs/c", "--trainer.logger.init_args.save_dir", "runs/d"]
    assert sweeps.run_roots(command) == [Path("runs/b"), Path("runs/a"), Path("runs/c"), Path("runs/d")]


def test_dry_run_prints_the_commands(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    main(["sweep", "configs/sweeps/pretrain-tiny.yaml", "--count", "2", "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("--model.init_args.optimizer.init_args.lr=" in line for line in lines)


def test_random_draws_follow_their_distributions():
    parameters = {
        "a": {"distribution": "log_uniform_values", "min": 1.0e-4, "max": 1.0e-2},
        "b": {"min": 2, "max": 5},
        "c": {"values": ["x", "y"], "probabilities": [0.0, 1.0]},
        "d": {"value": 7},
    }
    sweep = {"method": "random", "parameters": parameters}
    points = sweeps.sweep_points(sweep, count=50, seed=3)
    assert points == sweeps.sweep_points(sweep, count=50, seed=3)  # seeded
    assert all(1.0e-4 <= p["a"] <= 1.0e-2 and p["b"] in (2, 3, 4, 5) and p["c"] == "y" and p["d"] == 7
               for p in points)
    assert min(p["a"] for p in points) < 1.0e-3 < max(p["a"] for p in points)  # spread over the decades


@pytest.mark.parametrize("text, message", [
    ("method: bayes\nparameters: {x: {values: [1]}}\ncommand: ['${args}']", "bayes needs W&B's sweep controller"),
    ("method: grid\nparameters: {lr: {min: 0.1, max: 1.0}}\ncommand: ['${args}']", "parameter 'lr' has a distribution"),
    ("method: random\nparameters: {lr: {distribution: q_normal}}\ncommand: ['${args}']", "'q_normal' is not supported"),
    ("method: grid\nparameters: {x: {values: [1]}}\ncommand: [fit]", "command must be a list that passes ${args}"),
    ("method: grid\nparameters: {x: {values: [1]}}\ncommand: ['${args_json}', '${args}']", "uses ${args_json}"),
])
def test_sweeps_this_runner_cannot_run_are_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    with pytest.raises(sweeps.SweepError, match=message.replace("$", r"\$").replace("(", r"\(")):
        sweeps.load_sweep(path)


def test_the_verb_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="give --count N"):
        main(["sweep", str(ROOT / "configs" / "sweeps" / "grpo-tiny.yaml")])
    with pytest.raises(SystemExit, match="run astrai-pl sweep from the repository root"):
        main(["sweep", str(ROOT / "configs" / "sweeps" / "sft-debug.yaml"), "--dry-run"])
