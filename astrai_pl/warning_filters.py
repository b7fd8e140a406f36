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
"""

from __future__ import annotations

import logging
import warnings

DEPRECATIONS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)
LIGHTNING_CLI = r"lightning\.pytorch\.cli"  # the module whose calls into jsonargparse are deprecated there
EVAL_MODE = r"Found \d+ module\(s\) in eval mode at the start of training"
TIP_PREFIX = "💡 Tip:"
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTip(logging.Filter):
    """Drops Lightning's advertising tip; keeps every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP_PREFIX)


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
