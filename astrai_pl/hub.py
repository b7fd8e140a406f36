"""Models and data sets by their Hugging Face hub names (`Qwen/Qwen2.5-0.5B-Instruct`), read through
`huggingface_hub` into its cache and handed on as the local folder of that snapshot.

Which names are hub ids (one rule for `init_from`, `--model`, `--ckpt` and the data modules' `path`):

- a name that exists on disk is a local path, always;
- `hf://owner/name` is a hub id (`hf://datasets/owner/name` for a data set, as in `huggingface_hub`'s file system);
- `owner/name` (two plain parts, no leading `/`, `./`, `~`) is a hub id when neither it nor a folder `owner` exists
  here: a missing file under an existing folder stays a missing local file;
- anything else is a local path, and so is a name ending in a file suffix of ours (`.ckpt`, `.safetensors`, `.jsonl`,
  `.json`, `.parquet`, `.txt`, `.csv`): a missing file is reported as one.

A revision is `--revision REV` on the command line, or `owner/name@REV` in a config (a branch, tag or commit).

What is read: `huggingface_hub` itself honours HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT and the token
of HF_TOKEN (or `hf auth login`). Of a model repo only the config, safetensors weights (and their index) and
tokenizer files are fetched, never pickled weights (*.bin, *.pt) nor Python files; of a data set repo only data
files (parquet, jsonl, json, csv, txt) and its README (which names the splits). Nothing fetched runs code: the
weights are read by safetensors, a data set by `datasets`' packaged readers of those file types.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

HUB_PREFIX = "hf://"
REPO_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
HUB_NAME = re.compile(rf"({REPO_PART}/{REPO_PART})(?:@([^\s@]+))?")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json"]
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               *TOKENIZER_FILES]
DATA_FILES = ["*.parquet", "*.jsonl", "*.json", "*.csv", "*.txt", "README.md"]
LOCAL_SUFFIXES = (".ckpt", ".safetensors", ".jsonl", ".json", ".parquet", ".txt", ".csv")
NO_CODE = ["*.py", "*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt"]  # never fetched, whatever the patterns above say


class HubError(FileNotFoundError):
    """A hub id that could not be read: not found, an unknown revision, or no network and no cached copy."""


class HubName(NamedTuple):
    repo_id: str
    revision: str | None


def hub_name(name: str | Path, revision: str | None = None, repo_type: str = "model") -> HubName | None:
    """The hub repo `name` stands for under the rule in this module's docstring; None for a local path."""
    text = str(name)
    explicit = text.startswith(HUB_PREFIX)
    if explicit:
        text = text[len(HUB_PREFIX):]
        if repo_type == "dataset":
            text = text.removeprefix("datasets/")
    elif Path(text).exists() or Path(text.split("/")[0]).exists() or text.endswith(LOCAL_SUFFIXES):
        if revision:
            raise HubError(f"a revision ({revision!r}) is for a hub id, and {text!r} is a local path; leave it out")
        return None
    match = HUB_NAME.fullmatch(text)
    if match is None:
        if explicit:
            raise HubError(f"{name!r} is not a hub id; write hf://owner/name (optionally @revision)")
        return None
    if match.group(2) and revision and match.group(2) != revision:
        raise HubError(f"{name!r} names revision {match.group(2)!r} and --revision says {revision!r}; give one")
    return HubName(match.group(1), match.group(2) or revision)


def resolve_model(name: str | Path, revision: str | None = None) -> str:
    """Where to read the model `name` names: `name` itself, unchanged, when it is a local path (or an address),
    else the local folder of the hub repo's snapshot in the hub cache (fetched unless cached or offline).
    HubError names the id and the fix."""
    hub = hub_name(name, revision)
    if hub is None:
        return str(name)
    folder = _snapshot(hub, "model", MODEL_FILES)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise HubError(f"hub model {hub.repo_id!r} ({folder}) holds no config.json with safetensors weights; "
                       "astrai-pl reads only safetensors (pickled *.bin weights can run code when loaded). Fix: "
                       "pick a revision or a copy of the model that ships model.safetensors")
    return str(folder)


def resolve_tokenizer(name: str | Path, revision: str | None = None) -> str:
    """Where to read the tokenizer `name` names: `name` itself when it is a local path (or 'byte'), else the
    folder of the hub repo's tokenizer files (no weights fetched)."""
    hub = hub_name(name, revision)
    if hub is None:
        return str(name)
    folder = _snapshot(hub, "model", TOKENIZER_FILES)
    if not (folder / "tokenizer.json").is_file():
        raise HubError(f"hub model {hub.repo_id!r} ({folder}) has no tokenizer.json, the only tokenizer file read "
                       "here. Fix: pick a repo (or revision) that ships one, or pass a local tokenizer folder")
    return str(folder)


def resolve_dataset(name: str | Path, revision: str | None = None) -> str:
    """The local folder of the hub data set `name` names (its data files and README), or `name` itself,
    unchanged, when it is a local path."""
    hub = hub_name(name, revision, repo_type="dataset")
    if hub is None:
        return str(name)
    return str(_snapshot(hub, "dataset", DATA_FILES))


def resolve_model_option(ns: Any, option: str = "model") -> None:
    """`ns.<option>` of a command line (`--model`, `--ckpt`), with `ns.revision`, replaced by where to read it; a
    server's default model name (`--served-model-name` left out) becomes the hub id."""
    name, revision = getattr(ns, option), getattr(ns, "revision", None)
    hub = hub_name(name, revision)
    setattr(ns, option, resolve_model(name, revision))
    if hub is not None:
        ns.revision = None  # resolved: the option now names the snapshot's folder
        if getattr(ns, "served_model_name", "") is None:
            ns.served_model_name = hub.repo_id


def _snapshot(hub: HubName, repo_type: str, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download

    what = f"hub {repo_type} {hub.repo_id!r}" + (f" at revision {hub.revision!r}" if hub.revision else "")
    try:
        return Path(snapshot_download(hub.repo_id, repo_type=repo_type, revision=hub.revision,
                                      allow_patterns=patterns, ignore_patterns=NO_CODE))
    except Exception as err:  # each hub failure is named by _hub_error; anything else goes on as it was
        named = _hub_error(err, what, constants.HF_HUB_OFFLINE)
        if named is err:
            raise
        raise named from err


def _hub_error(err: Exception, what: str, offline: bool) -> Exception:
    """HubError naming `what` and the fix for `err`, one of huggingface_hub's; `err` itself when it is not."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, RevisionNotFoundError):
        return HubError(f"{what}: no such revision on the hub. Fix: give an existing branch, tag or commit")
    if isinstance(err, GatedRepoError):
        return HubError(f"{what} is gated: accept its terms on the hub, then set HF_TOKEN (or run hf auth login)")
    if isinstance(err, RepositoryNotFoundError):
        return HubError(f"{what} was not found on the hub. Fix: check the id (owner/name); for a private repo set "
                        "HF_TOKEN (or run hf auth login); for a local folder give a path that exists")
    if isinstance(err, LocalEntryNotFoundError):
        why = ("offline mode is on (HF_HUB_OFFLINE=1)" if offline else "the hub could not be reached")
        return HubError(f"{what}: {why} and the hub cache holds no copy of it. Fix: check the id, or fetch it once "
                        "with the network on (HF_HUB_OFFLINE unset, a token in HF_TOKEN if it is private), or point "
                        "HF_HOME / HF_HUB_CACHE at a cache that holds it")
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if isinstance(err, HfHubHTTPError):
        return HubError(f"{what}: the hub answered {first_line}. Fix: check the id and HF_TOKEN, or retry later")
    if type(err).__name__ == "IncompleteSnapshotError":
        return HubError(f"{what}: the cached copy is incomplete ({first_line}). Fix: fetch it again with the "
                        "network on")
    return err
