"""The few third-party messages a run prints that say nothing about the run, filtered by their exact text.

Each filter names the library and the message; every other warning is shown as usual. `install()` is called
once by the command line (cli.py) before anything else of Lightning runs.

- Lightning 2.6's `utilities/_pytree.py` calls `isinstance(treespec, LeafSpec)`, which torch >= 2.10
  deprecates; it is Lightning's code, printed on every fit, and nothing a user can change.
- LightningCLI calls jsonargparse APIs that jsonargparse 4.49 deprecates (`add_instantiator`,
  `instantiate_classes`, `skip_none`), shown wherever deprecation warnings are (pytest, `python -W default`,
  a sweep's `python -m astrai_pl.cli`): the deprecation warnings raised from Lightning's cli module are
  dropped; those our own code causes still show.
- Lightning's fit loop warns "Found N module(s) in eval mode at the start of training": in our objectives the
  only such modules are the frozen reference policies (`objectives.base.frozen_copy`), in eval mode on purpose.
- Lightning's logger connector prints a "💡 Tip" advertising a hosted logging service on every fit.
- Lightning's trainer notes "`Trainer(limit_val_batches=1)` was configured so 1 batch will be used." (1 read as a
  count, not as 100%) when a config asks for exactly that, as configs/grpo/debug.yaml does.
- Lightning's CSVLogger warns that its directory "exists and is not empty. Previous log files in this directory
  will be deleted" whenever the directory holds anything: always for the run directory astrai-pl made for it
  (its W&B files, a resumed run's checkpoints and config.yaml). Nothing there is deleted but metrics.csv, which
  a resumed run has already kept as metrics.before-resume-N.csv (checkpoint/runs.py), so `keep_run_dir_quiet`
  drops that warning for the run directory's own CSVLogger only; a logger the config points elsewhere still
  warns.
- torchao, imported by transformers and peft (evaluate, the LoRA tests, NF4), logs "Failed to load
  …/torchao/_C_mxfp8….so: …" and the same for `_C_cutlass_90a` when its wheel's optional MX-FP8 and Hopper
  CUTLASS kernels do not load with the installed torch. astrai_pl calls neither (NF4 is plain PyTorch), and
  torchao raises where one is called, so those two lines are dropped; a failure to load any other torchao
  library still shows.
- Importing torchao registers its `KernelPreference` and `ScaleCalculationMode` enums as pytree constants,
  which torch's `_pytree` logs as deprecated ("<enum …> is an Enum subclass and is now natively supported by
  torch.compile …"): torchao's call, dropped for torchao's enums only.

`install()` runs before any verb's module is imported (verbs.main) and when cli.py is imported.

Progress bars that redraw one line with carriage returns fill a log file or pipe with one endless line:
`library_bars_off_unless_terminal` (run by `install`) turns `datasets`' bars (loading files, `.map`) off when
stderr is not a terminal (nor a Jupyter kernel's), by HF_DATASETS_DISABLE_PROGRESS_BARS=1 (for later imports and the processes started
from here; a value the user set is kept) and by `datasets.disable_progress_bars()` once it is imported.
lm-eval's own bar (building each task's requests) is off then too, inside `evaluate` (evaluation/run.py). A
fit's progress shows as plain lines instead (callbacks/progress.py).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import IO

DEPRECATIONS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)
LIGHTNING_CLI = r"lightning\.pytorch\.cli"  # the module whose calls into jsonargparse are deprecated there
EVAL_MODE = r"Found \d+ module\(s\) in eval mode at the start of training"
TIP_PREFIX = "💡 Tip:"
ONE_BATCH = re.compile(r"`Trainer\(limit_(train|val|test|predict)_batches=1\)` was configured so 1 batch will be used\.$")
LOG_DIR_NOT_EMPTY = "Experiment logs directory {} exists and is not empty."
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


TORCHAO_KERNELS = re.compile(r"Failed to load \S*torchao/_C_(mxfp8|cutlass_90a)[\w.-]*\.so: .*", re.DOTALL)
PYTREE_ENUM = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
               "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future "
               "release.")
TORCHAO_LOGGERS = ("torchao", "torch.utils._pytree")


class _DropTorchaoNotices(logging.Filter):
    """Drops torchao's two optional kernel libraries failing to load and torch's notice on torchao's pytree enums;
    keeps every other record of those loggers."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            return not TORCHAO_KERNELS.fullmatch(str(record.msg))
        args = record.args if isinstance(record.args, tuple) else ()
        from_torchao = len(args) == 1 and str(getattr(args[0], "__module__", "")).startswith("torchao.")
        return not (record.msg == PYTREE_ENUM and from_torchao)


class _DropTip(logging.Filter):
    """Drops Lightning's advertising tip and its note on `limit_*_batches=1`; keeps every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith(TIP_PREFIX) or ONE_BATCH.match(message))


_installed = False


def install() -> None:
    """Add the filters (once per process; later calls do nothing)."""
    global _installed
    if _installed:
        return
    _installed = True
    for message in DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=LIGHTNING_CLI)
    warnings.filterwarnings("ignore", message=EVAL_MODE)
    for name in RANK_ZERO_LOGGERS:
        logging.getLogger(name).addFilter(_DropTip())
    for name in TORCHAO_LOGGERS:
        logging.getLogger(name).addFilter(_DropTorchaoNotices())
    library_bars_off_unless_terminal()


DATASETS_BARS_ENV = "HF_DATASETS_DISABLE_PROGRESS_BARS"


def is_terminal(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # a closed or bare stream
        return False


def library_bars_off_unless_terminal(stream: IO[str] | None = None) -> bool:
    """`datasets`' progress bars off when `stream` (stderr by default) is not a terminal, except in a Jupyter
    kernel (whose bars are widgets, not lines); whether they were turned off."""
    if is_terminal(sys.stderr if stream is None else stream) or "ipykernel" in sys.modules:
        return False
    os.environ.setdefault(DATASETS_BARS_ENV, "1")
    if "datasets" in sys.modules and os.environ[DATASETS_BARS_ENV].upper() in ("1", "ON", "YES", "TRUE"):
        from datasets.utils.tqdm import disable_progress_bars

        disable_progress_bars()
    return True


def keep_run_dir_quiet(run_dir: Path) -> None:
    """Drop CSVLogger's "exists and is not empty … will be deleted" warning for the CSVLogger that place_outputs
    (callbacks/resume.py) put in `run_dir`: save_dir its parent, name "", version its name."""
    log_dir = os.path.join(str(run_dir.parent), "", run_dir.name)  # as CSVLogger.log_dir joins them
    warnings.filterwarnings("ignore", message=re.escape(LOG_DIR_NOT_EMPTY.format(log_dir)))
