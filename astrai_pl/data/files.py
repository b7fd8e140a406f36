"""Local data files: the content fingerprint every cache is keyed by, the UTF-8 check, and loading.

A cache keyed by a file's path serves the old rows after the file is edited in place, and so does the
cache `datasets` keeps of a local file, which is keyed by its path and mtime. Every cache of this
package is keyed by `source_fingerprint` instead: a file's size, its mtime in nanoseconds and a SHA-256
of its bytes — all of them when the file holds at most FULL_HASH_BYTES (64 MiB), else its first and
last SAMPLE_BYTES (4 MiB each). An edit of a file up to 64 MiB is therefore seen whatever its size
and mtime; an edit of a larger file is seen when it changes the size, the mtime or either end (one in
the middle that keeps the size and restores the mtime is not: delete the cache after such an edit).
The sample keeps the cost of a start at 8 MiB read per large file instead of a whole read.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from pathlib import Path

import datasets
from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetGenerationError

from .rows import UTF8_FIX, UTF8_SKIP_FIX, DataError, Dropped, check_policy, decode_line, log_skipped

FILE_LOADERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
FULL_HASH_BYTES = 64 * 2**20
SAMPLE_BYTES = 4 * 2**20
CHUNK_BYTES = 2**20


def file_fingerprint(path: str | Path) -> str:
    """Size, mtime (ns) and a SHA-256 of the bytes (of both ends only, above FULL_HASH_BYTES) of a file."""
    stat = os.stat(path)
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(path, "rb") as handle:
        if stat.st_size <= FULL_HASH_BYTES:
            while chunk := handle.read(CHUNK_BYTES):
                digest.update(chunk)
        else:
            digest.update(handle.read(SAMPLE_BYTES))
            handle.seek(stat.st_size - SAMPLE_BYTES)
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def source_fingerprint(path: str) -> str:
    """The fingerprint of a local file, of every file of a local directory but the caches `datasets`
    writes into it (cache-*.arrow), or (a hub name) the name."""
    p = Path(path)
    if p.is_file():
        return file_fingerprint(p)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("cache-"))
        listing = "\n".join(f"{f.relative_to(p).as_posix()}:{file_fingerprint(f)}" for f in files)
        return hashlib.sha256(listing.encode()).hexdigest()[:16]
    return path


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or datasets.config.HF_DATASETS_CACHE)


def content_named_copy(data: bytes, suffix: str, cache_dir: str | None) -> Path:
    """`data` written once to a file named by its hash (under `cache_dir`), so that it caches by content."""
    folder = cache_root(cache_dir) / "astrai_pl_checked_rows"
    target = folder / f"{hashlib.sha256(data).hexdigest()[:16]}{suffix}"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial_file = target.with_suffix(f".tmp{os.getpid()}")
        partial_file.write_bytes(data)
        os.replace(partial_file, target)
    return target


def _is_utf8(path: Path) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def utf8_text(path: Path, on_bad_row: str | None, cache_dir: str | None, dropped: Dropped | None) -> Path:
    """`path` when it is UTF-8 throughout; else a DataError naming the first bad line, or (on_bad_row=
    'skip') a copy without the bad lines, which are counted and logged. None: no policy to offer."""
    if _is_utf8(path):
        return path
    good, bad = [], []
    fix = UTF8_FIX if on_bad_row is None else UTF8_SKIP_FIX
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                decode_line(raw, fix)
                good.append(raw)
            except DataError as err:
                bad.append(err.at(str(path), number))
    assert bad, path  # a newline never occurs inside a UTF-8 sequence: some line holds the bad bytes
    if on_bad_row != "skip":
        raise bad[0]
    log_skipped(bad, str(path), dropped)
    return content_named_copy(b"".join(good), path.suffix, cache_dir)


def load_file(
    path: str | Path,
    cache_dir: str | None,
    on_bad_row: str | None = None,
    dropped: Dropped | None = None,
    source: str | None = None,
) -> Dataset:
    """A local txt/json/jsonl/parquet file through `datasets`, its cache kept in a folder named by the
    file's fingerprint (see the module's docstring); text files are checked for UTF-8 first (a bad line
    is an error, or skipped with on_bad_row='skip'). A file `datasets` cannot turn into a table is a
    DataError naming `source` (default: the file)."""
    if on_bad_row is not None:
        check_policy(on_bad_row)
    source = source or str(path)
    path = Path(path)
    if path.suffix in TEXT_SUFFIXES:
        path = utf8_text(path, on_bad_row, cache_dir, dropped)
    folder = cache_root(cache_dir) / "by_content" / file_fingerprint(path)
    try:
        return load_dataset(FILE_LOADERS[path.suffix], data_files=str(path), split="train", cache_dir=str(folder))
    except DatasetGenerationError as err:
        raise DataError(
            f"datasets could not build a table from the rows ({err.__cause__ or err})",
            fix="give each field one JSON type in every row, nested a few levels at most",
            source=source,
        ) from err
