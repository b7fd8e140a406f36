"""The embedded default corpus: the documentation that ships inside every CPython.

`pydoc_data.topics` (the language reference topics behind `help()`) plus the docstrings of the
standard library's modules, classes and functions, read from the installed sources with `ast`
(nothing is imported, nothing is copied into this repository). The held-out split is chosen by a
hash of each document's title, so it is the same on every machine and run.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from pathlib import Path

SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__phello__"}
MIN_DOCSTRING_CHARS = 200


def _stdlib_docstrings() -> list[dict[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts))
    docs = []
    for file in files:
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = file.relative_to(root).with_suffix("").as_posix().replace("/", ".")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= MIN_DOCSTRING_CHARS:
                    name = module if isinstance(node, ast.Module) else f"{module}.{node.name}:{node.lineno}"
                    docs.append({"title": f"doc:{name}", "text": text})
    return docs


def embedded_documents() -> list[dict[str, str]]:
    """Every document of the embedded corpus as {"title", "text"}, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [{"title": f"topic:{name}", "text": text} for name, text in sorted(topics.items())]
    return docs + _stdlib_docstrings()


def corpus_version() -> str:
    """Identifies the embedded corpus of this interpreter (it changes with the Python version)."""
    return f"cpython-{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"


def is_held_out(title: str, fraction: float, seed: int = 0) -> bool:
    """Deterministic split: a document is held out when the hash of (seed, title) falls below `fraction`."""
    digest = hashlib.sha256(f"{seed}:{title}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
