"""Weights & Biases through the `wandb:` section of a config: offline without an API key, a run directory
holding the resolved config, the metrics, the tables of sample generations and the exported model; with the
switch off, nothing of W&B at all. Sample generations and their rewards, without W&B."""

import csv
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import wandb
import yaml
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from wandb.proto import wandb_internal_pb2

from astrai_pl.callbacks import SampleGenerations, WandbConfig
from astrai_pl.callbacks.samples import held_out_samples
from astrai_pl.callbacks.tracking import has_wandb_credentials
from astrai_pl.cli import lightning_main
from astrai_pl.data import GRPOData, SFTData
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import GRPO, SFT
from astrai_pl.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
SFT_DEBUG = ROOT / "configs" / "sft" / "debug.yaml"
BLOCK = 32768  # a .wandb file is a log of records in 32 KiB blocks, after a 7-byte file header


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a .wandb file. Each chunk has a 7-byte header (crc32, length, type: 1 whole record,
    2 first, 3 middle, 4 last piece); a block's tail shorter than a header is padding."""
    raw, pos, pieces, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pieces += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pieces))
            pieces = b""
    return records


def logged(records, key: str) -> list[float]:
    """Every value of history key `key` (W&B stores "train/loss" as the nested key ["train", "loss"])."""
    return [json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "history"
            for item in r.history.item if (item.key or "/".join(item.nested_key)) == key]


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


@pytest.mark.slow
def test_offline_run_holds_config_metrics_samples_and_model(tmp_path, monkeypatch, no_credentials):
    monkeypatch.chdir(tmp_path)  # the config writes under runs/sft-debug/version_0/
    cli = lightning_main(["--config", str(SFT_DEBUG), "--wandb.enabled", "true", "--wandb.log_model", "true",
                          "--trainer.enable_progress_bar", "false"], run=False)
    assert [type(lg) for lg in cli.trainer.loggers] == [CSVLogger, WandbLogger]  # log_dir stays the CSV one
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # a second run in the same process finishes the first one rather than logging into it
    lightning_main(["--config", str(SFT_DEBUG), "--wandb.enabled", "true"], run=False)
    assert wandb.run is None

    (run_dir,) = (tmp_path / "runs" / "sft-debug" / "version_0" / "wandb").glob("offline-run-*")
    resolved = yaml.safe_load((run_dir / "files" / "resolved-config.yaml").read_text())
    assert resolved["model"]["class_path"] == "astrai_pl.objectives.SFT" and resolved["wandb"]["enabled"]
    (log,) = run_dir.glob("run-*.wandb")
    records = wandb_records(log)
    config = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for item in r.config.update}
    assert config["model"]["init_args"]["arch"]["hidden_size"] == 64
    assert config["trainer"]["max_steps"] == 8
    with open(Path(cli.trainer.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for key, count in (("train/loss", 4), ("val/loss", 4)):  # the same values as the CSV logger's
        in_csv = [float(row[key]) for row in rows if row[key]]
        assert logged(records, key) == pytest.approx(in_csv) and len(in_csv) == count

    tables = sorted((run_dir / "files" / "media" / "table").glob("samples_*.table.json"))
    samples = [row for path in tables for row in json.loads(path.read_text())["data"]]  # step, prompt, completion, reward
    assert sorted(row[0] for row in samples) == [4] * 4 + [8] * 4  # samples_every_n_steps: 4 in the debug config
    assert all(row[1].startswith("What is ") and row[3] in (0.0, 1.0) for row in samples)
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [a.name for a in artifacts if a.type == "model"] == [f"model-{log.stem.removeprefix('run-')}"]
    assert (tmp_path / "runs" / "sft-debug" / "version_0" / "hf" / "final" / "config.json").is_file()


def test_switched_off_there_is_no_wandb(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = lightning_main(["--config", str(SFT_DEBUG)], run=False)
    assert not any(isinstance(lg, WandbLogger) for lg in cli.trainer.loggers)
    assert not any(isinstance(cb, SampleGenerations) for cb in cli.trainer.callbacks)


def test_credentials_come_from_the_environment_or_netrc(monkeypatch, tmp_path, no_credentials):
    assert not has_wandb_credentials()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert has_wandb_credentials()
    monkeypatch.delenv("WANDB_API_KEY")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine wandb.example.com\n  login user\n  password " + "y" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert not has_wandb_credentials()  # an entry for another server
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert has_wandb_credentials()


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="wandb.num_samples=0"):
        WandbConfig(num_samples=0)
    with pytest.raises(ValueError, match="wandb.samples_every_n_steps=-1"):
        WandbConfig(samples_every_n_steps=-1)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        SampleGenerations(prompts=["Hello", ""])
    with pytest.raises(ValueError, match="give the prompts as a list of strings"):
        held_out_samples(SFTData(path="mine.jsonl"), 4)


def generate(callback, module, datamodule=None):
    callback.setup(SimpleNamespace(datamodule=datamodule), module, "fit")
    return callback.generate(module)


def test_samples_are_scored_by_the_objectives_reward_functions():
    seen = {}

    def length_reward(prompts, completions, answer, completion_ids, **kwargs):
        seen.update(prompt=prompts[0], completion=completions[0], answer=answer,
                    lengths=[len(ids) for ids in completion_ids])
        return [float(len(ids)) for ids in completion_ids]

    torch.manual_seed(0)
    module = GRPO(arch=ModelConfig.from_name("debug"), tokenizer=Tokenizer.byte_level(),
                  reward_funcs=[length_reward], reward_weights=[0.5], beta=0.0)
    data = GRPOData()
    rows = generate(SampleGenerations(num_prompts=3, max_new_tokens=5), module, data)
    problems = data.held_out_problems(3)
    assert [r["prompt"] for r in rows] == [p.question for p in problems]
    assert seen["answer"] == [p.answer for p in problems]
    assert seen["prompt"] == [{"role": "user", "content": problems[0].question}]  # conversational, as in GRPO
    assert seen["completion"] == [{"role": "assistant", "content": rows[0]["completion"]}]
    assert [r["reward"] for r in rows] == [0.5 * n for n in seen["lengths"]]  # the weighted sum
    assert all(n <= 5 for n in seen["lengths"])


def test_samples_of_other_objectives_score_exact_match_or_nothing():
    torch.manual_seed(0)
    module = SFT(arch=ModelConfig.from_name("debug"), tokenizer=Tokenizer.byte_level())
    rows = generate(SampleGenerations(num_prompts=2, max_new_tokens=4), module, SFTData())
    assert [r["reward"] in (0.0, 1.0) for r in rows] == [True, True]
    rows = generate(SampleGenerations(prompts=["Once upon a time"], chat=False, max_new_tokens=4), module)
    assert rows[0]["prompt"] == "Once upon a time" and rows[0]["reward"] is None
    assert module.model.training  # put back in train mode after generating
