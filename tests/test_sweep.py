"""W&B sweep files: the command a W&B agent runs lands every swept value in the trained run, each shipped
sweep's parameters are config keys, and `astrai-pl sweep` runs the agent's commands without a server."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from wandb.sdk.launch.sweeps import utils as wandb_sweeps

from astrai_pl import sweep as sweeps
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

    ckpt = torch.load(tmp_path / "runs" / "sft-debug" / "checkpoints" / "last.ckpt", weights_only=False)
    hparams = {"model": {"init_args": ckpt["hyper_parameters"]},
               "data": {"init_args": ckpt["datamodule_hyper_parameters"]}}
    for name, value in point.items():
        assert value_at(hparams, name) == value, name
    assert any((tmp_path / "runs" / "sft-debug" / "wandb").glob("offline-run-*"))  # the run logged to W&B


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
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    monkeypatch.chdir(ROOT)
    main(["sweep", "configs/sweeps/sft-debug.yaml", "--count", "3"])
    sweep = sweeps.load_sweep(ROOT / "configs" / "sweeps" / "sft-debug.yaml")
    points = sweeps.grid_points(sweep["parameters"])
    assert len(points) == 8 and [cmd for cmd, _ in calls] == [sweeps.trial_command(sweep, p) for p in points[:3]]
    assert [(env["WANDB_RUN_GROUP"], env["WANDB_NAME"]) for _, env in calls] == [
        ("sft-debug", f"sft-debug-{n}") for n in (1, 2, 3)]
    assert "3: ok" in capsys.readouterr().out


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
