"""`astrai-pl` itself: the top-level help lists every verb, `--help`, `generate --help` and `chat --help` load
no torch and `generate` no training stack,
`predict` and LightningCLI's optimizer options are refused naming what to use instead, `fit --help` opens
with where its options are shown best."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astrai_pl.verbs import VERBS, main

ROOT = Path(__file__).resolve().parent.parent
DEBUG = ROOT / "configs/sft/debug.yaml"
TRAINING_STACK = ("lightning", "jsonargparse", "transformers", "datasets", "wandb", "torchmetrics")


def modules_loaded_by(argv: list[str]) -> set[str]:
    """Top-level packages in sys.modules after `astrai-pl ARGV` (which exits) in a fresh interpreter."""
    code = ("import json, sys\nfrom astrai_pl.verbs import main\ntry:\n    main(json.loads(sys.argv[1]))\n"
            "except SystemExit:\n    pass\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_top_level_help_lists_every_verb_with_a_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for name, verb in VERBS.items():
        assert f"  {name} " in out and verb.summary in out
    assert {"tokenizer", "convert", "generate", "chat", "sweep", "serve", "evaluate", "fit"} <= set(VERBS)
    assert "predict" not in out


def test_the_console_script_runs_the_verbs_table():
    """pyproject's `astrai-pl` entry point is verbs.main, so the top-level help needs no Lightning."""
    scripts = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["astrai-pl"] == "astrai_pl.verbs:main"


def test_help_loads_neither_torch_nor_the_training_stack():
    loaded = modules_loaded_by(["--help"])
    assert not loaded & {"torch", "numpy", *TRAINING_STACK}


@pytest.mark.parametrize("verb", ["generate", "chat"])
def test_generate_and_chat_help_load_no_torch(verb):
    """Their options are read before the engine is imported (command_options.py), so --help is immediate."""
    loaded = modules_loaded_by([verb, "--help"])
    assert "astrai_pl" in loaded and not loaded & {"torch", "numpy", *TRAINING_STACK}


@pytest.mark.slow  # torch loads: seconds
def test_generate_loads_no_training_stack(tmp_path):
    loaded = modules_loaded_by(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"])
    assert "torch" in loaded and not loaded & set(TRAINING_STACK)


def test_the_sampling_options_default_to_sampling_params():
    from astrai_pl.command_options import SAMPLING_DEFAULTS, generate_parser
    from astrai_pl.inference import SamplingParams

    defaults = vars(generate_parser().parse_args(["--model", "m", "--prompt", "p"]))
    assert {name: getattr(SamplingParams(), name) for name in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    assert {name: defaults[name] for name in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS


def test_predict_points_to_generate():
    with pytest.raises(SystemExit, match=r"(?s)no predict.*astrai-pl generate --model .* --input prompts\.jsonl"):
        main(["predict", "--config", str(DEBUG)])


def test_an_unknown_verb_is_named_with_the_closest_one():
    with pytest.raises(SystemExit, match=r"unknown command 'genrate' \(did you mean 'generate'\?\)"):
        main(["genrate"])


@pytest.mark.parametrize("option, field", [
    (["--optimizer", "torch.optim.SGD"], "model.init_args.optimizer"),
    (["--optimizer.lr=0.1"], "model.init_args.optimizer"),
    (["--lr_scheduler", "torch.optim.lr_scheduler.ConstantLR"], "model.init_args.scheduler"),
])
def test_lightnings_optimizer_options_are_refused_naming_the_objectives_field(option, field):
    with pytest.raises(SystemExit, match=rf"--{option[0][2:].split('.')[0].split('=')[0]} \(LightningCLI's\) would "
                                         rf"replace .* set the objective's field {field} instead"):
        main(["fit", "--config", str(DEBUG), *option])


def test_an_optimizer_key_in_a_config_file_is_refused(tmp_path):
    config = yaml.safe_load(DEBUG.read_text())
    config["optimizer"] = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}
    path = tmp_path / "with-optimizer.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit, match=r"--optimizer \(LightningCLI's\).*model\.init_args\.optimizer"):
        main(["fit", "--config", str(path)])


def test_fit_help_opens_with_one_usage_line_and_print_config(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    head = out.split("options:")[0]
    assert head.startswith("usage: astrai-pl fit --config FILE") and len(head.splitlines()) < 12
    assert "--print_config=comments" in " ".join(head.split())
    assert "--optimizer" not in out and "--lr_scheduler" not in out
