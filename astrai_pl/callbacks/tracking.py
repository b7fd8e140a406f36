"""Weights & Biases: the `wandb:` section of every config, the logger it adds, and the model artifact.

`astrai-pl fit --config … --wandb.enabled true` adds a `WandbLogger` next to the config's own loggers (the
CSV logger stays first, so `trainer.log_dir` does not move), logs the resolved config into the run, a table
of sample generations every `samples_every_n_steps` steps (`SampleGenerations`) and, with `log_model`, the
final Hugging Face export as an artifact (`ModelArtifact`). Without an API key the run is written offline
under `trainer.default_root_dir/wandb/` and `wandb sync` uploads it later; `WANDB_MODE`, when set, decides
instead. Only global rank 0 talks to W&B.
"""

from __future__ import annotations

import netrc
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import lightning as L
import yaml
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from .export import HFExport
from .samples import SampleGenerations

DEFAULT_HOST = "https://api.wandb.ai"


@dataclass
class WandbConfig:
    """Weights & Biases logging for one run; off unless `enabled`. See docs/tracking.md."""

    enabled: bool = False
    """Log to W&B next to the config's own loggers: the resolved config, every metric, sample generations and,
    with log_model, the exported model. Offline (under trainer.default_root_dir/wandb) without an API key."""
    project: str = "astrai-pl"
    """W&B project of the run (a sweep's runs go to the sweep's project)."""
    entity: str | None = None
    """W&B team or user; None = the account's default."""
    name: str | None = None
    """Run name; None = $WANDB_NAME, else a name W&B picks."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""
    samples_every_n_steps: int = 50
    """Optimizer steps between two tables of sample generations (prompt / completion / reward); 0 = none."""
    num_samples: int = 4
    """Held-out problems completed for each table (given sample_prompts are all used)."""
    sample_prompts: list[str] | None = None
    """Prompts to complete; None = the data module's held-out arithmetic problems (SFT, DPO, GRPO data
    without a path), each scored against its answer."""
    sample_chat: bool = True
    """Send each prompt as a user turn through the chat template; false = plain text (pretrained models)."""
    sample_max_tokens: int = 32
    """Most tokens generated per sample (greedy decoding)."""
    log_model: bool = False
    """Upload the final Hugging Face export (an HFExport callback's, else one written under
    default_root_dir/hf) as a W&B artifact of type "model" when training ends."""

    def __post_init__(self) -> None:
        if self.samples_every_n_steps < 0:
            raise ValueError(f"wandb.samples_every_n_steps={self.samples_every_n_steps}: must be >= 0 "
                             "(0 logs no samples)")
        if self.num_samples < 1:
            raise ValueError(f"wandb.num_samples={self.num_samples}: must be >= 1; to log no samples set "
                             "wandb.samples_every_n_steps 0")
        if self.sample_max_tokens < 1:
            raise ValueError(f"wandb.sample_max_tokens={self.sample_max_tokens}: must be >= 1")
        if self.sample_prompts is not None and not self.sample_prompts:
            raise ValueError("wandb.sample_prompts=[]: give at least one prompt, or null for the data "
                             "module's held-out problems")


def has_wandb_credentials() -> bool:
    """True when W&B would find an API key: $WANDB_API_KEY, $WANDB_IDENTITY_TOKEN_FILE, or a `wandb login`
    entry in ~/.netrc ($NETRC) for the server in $WANDB_BASE_URL."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", DEFAULT_HOST)).netloc
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(entry and entry[2])


def wandb_logger(config: WandbConfig, save_dir: str | Path) -> WandbLogger:
    """The logger of a run configured by `config`, writing under `save_dir/wandb`; offline without credentials
    (unless $WANDB_MODE says otherwise)."""
    finish_previous_run()
    offline = "WANDB_MODE" not in os.environ and not has_wandb_credentials()
    if offline:
        rank_zero_info(f"W&B: no API key found, logging offline under {save_dir}/wandb "
                       "(`wandb sync` uploads it; `wandb login` or WANDB_API_KEY logs online)")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    logger = WandbLogger(name=config.name, save_dir=str(save_dir), project=config.project,
                         entity=config.entity, tags=list(config.tags), offline=offline)
    logger._wandb_init.pop("anonymous", None)  # Lightning passes anonymous=None, which wandb warns has no effect
    return logger


_started_runs: list[str] = []  # ids of the W&B runs our loggers started in this process


def finish_previous_run() -> None:
    """Finish the W&B run that an earlier fit in this process started and left open, so that a notebook
    which fits twice gets two runs (Lightning's WandbLogger would log the second fit into the open one).
    A run started by anyone else is left alone."""
    import wandb

    if wandb.run is not None and wandb.run.id in _started_runs:
        wandb.finish()


def with_wandb(logger: Logger | list[Logger] | bool | None, wandb: WandbLogger) -> list[Logger]:
    """The trainer's loggers with W&B appended; `true` / `null` (Lightning's default logger) and `false`
    give W&B alone."""
    if logger is None or isinstance(logger, bool):
        return [wandb]
    return [*(logger if isinstance(logger, list) else [logger]), wandb]


def wandb_loggers(trainer: L.Trainer) -> list[WandbLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]


def log_config(trainer: L.Trainer, text: str) -> None:
    """The resolved config (`text`, YAML) into each W&B run of `trainer`: as the run's config, searchable and
    comparable across runs, and as the file resolved-config.yaml. Rank 0 only."""
    for logger in wandb_loggers(trainer):
        run = logger.experiment
        _started_runs.append(run.id)
        run.config.update(yaml.safe_load(text), allow_val_change=True)
        (Path(run.dir) / "resolved-config.yaml").write_text(text)


class ModelArtifact(L.Callback):
    """When training ends, upload the final Hugging Face export to each W&B logger as an artifact named
    `model-<run id>` of type "model", aliased "final".

    The export is the HFExport callback's `dirpath/final` when the trainer has one (it runs first: callbacks
    added by the `wandb:` section come after the config's); otherwise this callback writes one under
    `fallback_dir/final`, with every rank taking part as an export needs.

    Args:
        fallback_dir: Where to export when the trainer has no HFExport callback.
    """

    def __init__(self, fallback_dir: str = "runs/hf"):
        self.fallback_dir = fallback_dir
        self.path: Path | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        export = next((c for c in trainer.callbacks if isinstance(c, HFExport) and c.at_end), None)
        if export is None:
            self.path = HFExport(dirpath=self.fallback_dir).export(trainer, pl_module, "final")
        else:
            self.path = export.dirpath / "final"
        if not trainer.is_global_zero:
            return
        import wandb

        for logger in wandb_loggers(trainer):
            run = logger.experiment
            artifact = wandb.Artifact(name=f"model-{run.id}", type="model",
                                      metadata={"step": trainer.global_step, "export": str(self.path)})
            artifact.add_dir(str(self.path))
            run.log_artifact(artifact, aliases=["final"])


def tracking_callbacks(config: WandbConfig, save_dir: str | Path) -> list[L.Callback]:
    """The callbacks `config` asks for: sample generations, and the model artifact."""
    callbacks: list[L.Callback] = []
    if config.samples_every_n_steps:
        callbacks.append(SampleGenerations(config.samples_every_n_steps, config.sample_prompts, config.num_samples,
                                           config.sample_chat, config.sample_max_tokens))
    if config.log_model:
        callbacks.append(ModelArtifact(fallback_dir=str(Path(save_dir) / "hf")))
    return callbacks
