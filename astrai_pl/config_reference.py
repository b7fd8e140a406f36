"""docs/configuration-reference.md, generated from the docstrings of everything a config can name.

    python -m astrai_pl.config_reference            # rewrite docs/configuration-reference.md
    python -m astrai_pl.config_reference --check    # exit 1 when the file is out of date (a test does this)

One section per class, one row per argument: its name, type, default and documentation. Dataclasses
(ModelConfig, LoraConfig, WandbConfig, Arithmetic, Section) document each field in the docstring under it;
every other class in the `Args:` section of its `__init__` (or class) docstring — the same text `--help` and
`--print_config=comments` show.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import docstring_parser
from torch.optim.lr_scheduler import LRScheduler

from .callbacks import (
    HFExport,
    JSONLLogger,
    ModelArtifact,
    NonFiniteGuard,
    RNGState,
    SampleGenerations,
    StopOnSignal,
    Throughput,
    WandbConfig,
)
from .callbacks.safety import SafetyConfig
from .data import DPOData, GRPOData, KTOData, PretrainData, SFTData
from .data.preprocess import Section
from .data.sources import Arithmetic
from .model import LoraConfig, ModelConfig
from .objectives import DPO, GRPO, KTO, ORPO, RLOO, SFT, Distill, OnlineDPO, Pretrain, RewardModel, SimPO
from .objectives.schedules import WarmupCosine, WarmupStableDecay
from .strategy import FSDP2Strategy

OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "configuration-reference.md"

# (heading, where it goes in a config, its classes)
GROUPS: list[tuple[str, str, list[type]]] = [
    ("Weights & Biases", "`wandb:` (top level)", [WandbConfig]),
    ("Run protections", "`safety:` (top level)", [SafetyConfig]),
    ("Objectives", "`model.class_path` and `model.init_args`", [Pretrain, SFT, DPO, GRPO, KTO, ORPO, SimPO,
                                                                 RewardModel, OnlineDPO, RLOO, Distill]),
    ("Model shape", "`model.init_args.arch`", [ModelConfig]),
    ("LoRA adapter", "`model.init_args.lora`", [LoraConfig]),
    ("Learning-rate schedules", "`model.init_args.scheduler`", [WarmupCosine, WarmupStableDecay]),
    ("Data modules", "`data.class_path` and `data.init_args`", [PretrainData, SFTData, DPOData, GRPOData,
                                                                  KTOData]),
    ("Data parts", "`data.init_args.sections` and `data.init_args.synthetic`", [Section, Arithmetic]),
    ("Strategy", "`trainer.strategy`", [FSDP2Strategy]),
    ("Callbacks and loggers", "`trainer.callbacks` and `trainer.logger`",
     [HFExport, Throughput, NonFiniteGuard, StopOnSignal, RNGState, JSONLLogger, SampleGenerations,
      ModelArtifact]),
]


@dataclasses.dataclass
class Argument:
    name: str
    type: str
    default: str
    doc: str


# -- reading the classes -----------------------------------------------------------------------------------
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its annotated assignment, for a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def show_default(value: Any) -> str:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return "required"
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return str(value)


def dataclass_arguments(cls: type) -> list[Argument]:
    docs = attribute_docs(cls)
    arguments = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        arguments.append(Argument(f.name, str(f.type), show_default(default), docs.get(f.name, "")))
    return arguments


def init_arguments(cls: type) -> list[Argument]:
    docs = {}
    for text in (cls.__doc__, cls.__init__.__doc__):
        docs.update({p.arg_name: p.description or "" for p in docstring_parser.parse(text or "").params})
    # a schedule's optimizer is passed by the objective, never configured
    skipped = {"self", "optimizer"} if issubclass(cls, LRScheduler) else {"self"}
    parameters = inspect.signature(cls.__init__).parameters
    own = [Argument(name, str(p.annotation), show_default(p.default), docs.get(name, ""))
           for name, p in parameters.items()
           if name not in skipped and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return own + forwarded_arguments(cls, {a.name for a in own})


def forwarded_arguments(cls: type, own: set[str]) -> list[Argument]:
    """The arguments an `__init__(…, **kwargs)` passes on to its base class's `__init__` (as jsonargparse
    follows them), documented where the base class declares them."""
    kinds = {p.kind for p in inspect.signature(cls.__init__).parameters.values()}
    base = next((b for b in cls.__mro__[1:] if "__init__" in vars(b)), object)
    if inspect.Parameter.VAR_KEYWORD not in kinds or base is object:
        return []
    return [a for a in init_arguments(base) if a.name not in own]


def arguments(cls: type) -> list[Argument]:
    return dataclass_arguments(cls) if dataclasses.is_dataclass(cls) else init_arguments(cls)


def undocumented(cls: type) -> list[str]:
    """The arguments of `cls` without documentation."""
    return [a.name for a in arguments(cls) if not a.doc]


# -- writing the page --------------------------------------------------------------------------------------
def cell(text: str) -> str:
    """Text for one table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def public_path(cls: type) -> str:
    """The shortest import path of `cls`, as a config's class_path names it (astrai_pl.objectives.SFT)."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:end]))
        if getattr(module, cls.__name__, None) is cls:
            return f"{'.'.join(parts[:end])}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def summary(cls: type) -> str:
    """The first paragraph of the class docstring (… when it runs on into the next)."""
    text = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
    return f"{text} …" if text.endswith((",", ":")) else text


def section(cls: type) -> list[str]:
    lines = [f"### {cls.__name__}", "", f"`{public_path(cls)}`"]
    if summary(cls):
        lines[-1] += f": {summary(cls)}"
    rows = arguments(cls)
    if not rows:
        return [*lines, "", "No arguments.", ""]
    lines += ["", "| argument | type | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{a.name}` | `{cell(a.type)}` | `{cell(a.default)}` | {cell(a.doc) or '—'} |" for a in rows]
    return [*lines, ""]


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated by `python -m astrai_pl.config_reference` from the docstrings in the code; a test keeps it",
        "current. How a config is put together is in [configuration](configuration.md); this page lists every",
        "argument of every class a config of this project names, with its type and default.",
        "",
    ]
    for heading, where, classes in GROUPS:
        lines += [f"## {heading}", "", f"In a config: {where}.", ""]
        for cls in classes:
            lines += section(cls)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m astrai_pl.config_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the code")
    ns = parser.parse_args(argv)
    text = render()
    if ns.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            sys.exit(f"{OUTPUT} is out of date; run python -m astrai_pl.config_reference")
        return
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
