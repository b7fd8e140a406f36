"""Building and loading the fused CUDA kernels, and the flag that says whether they run here.

The sources live in the repository's `cuda/` folder (or `ASTRAI_CUDA_SRC`). `load()` returns the compiled
extension: the one built at install time (`ASTRAI_BUILD_CUDA=1 pip install --no-build-isolation -e .`),
else a just-in-time build with ninja through `torch.utils.cpp_extension.load`, cached in
`TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`) so only the first use pays for it.

`available()` is the flag: True when a CUDA device is visible and the extension loads. Tests force it
either way with `override_available(...)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("astrai_pl.ops")

EXTENSION_NAME = "astrai_pl_kernels"


class KernelsUnavailable(RuntimeError):
    """The fused kernels cannot run here: no CUDA device, no toolkit or sources, or the build failed."""


def cuda_dir() -> Path:
    """The folder holding the .cu/.cpp sources: `ASTRAI_CUDA_SRC`, else `cuda/` at the repository root."""
    override = os.environ.get("ASTRAI_CUDA_SRC")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "cuda"


def sources() -> list[Path]:
    """The binding first, then every kernel file."""
    folder = cuda_dir()
    return [folder / "bindings.cpp", *sorted(folder.glob("*.cu"))]


_module: ModuleType | None = None
_error: str | None = None


class Override:
    """A flag that tests can force inside a block: True or False, or None (detected as usual)."""

    def __init__(self) -> None:
        self.value: bool | None = None

    @contextlib.contextmanager
    def __call__(self, value: bool | None) -> Iterator[None]:
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous


_override = Override()
_fallback_logged = False


def load() -> ModuleType:
    """The compiled extension; raises KernelsUnavailable (once per process it tries) saying why not."""
    global _module, _error
    if _module is not None:
        return _module
    if _error is not None:
        raise KernelsUnavailable(_error)
    try:
        _module = _load()
    except KernelsUnavailable as err:
        _error = str(err)
        raise
    return _module


def _load() -> ModuleType:
    if not torch.cuda.is_available():
        raise KernelsUnavailable(
            f"no CUDA device is visible (torch {torch.__version__}: torch.cuda.is_available() is False); "
            "the PyTorch references in astrai_pl.ops run on any device"
        )
    with contextlib.suppress(ImportError):  # built at install time
        from astrai_pl import _kernels

        return _kernels
    files = sources()
    missing = [str(f) for f in files if not f.is_file()]
    if missing or len(files) < 2:
        raise KernelsUnavailable(
            f"kernel sources not found in {cuda_dir()} ({', '.join(missing) or 'no .cu files'}); run from a "
            "checkout (pip install -e .), set ASTRAI_CUDA_SRC, or build at install with ASTRAI_BUILD_CUDA=1"
        )
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise KernelsUnavailable("no CUDA toolkit found: put nvcc on PATH or set CUDA_HOME")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as err:
        raise KernelsUnavailable("building the kernels needs ninja: pip install ninja") from err
    log.info("astrai_pl.ops: building the fused CUDA kernels (first use; cached afterwards)")
    try:
        return cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(f) for f in files],
            extra_include_paths=[str(cuda_dir())],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17"],
            verbose=os.environ.get("ASTRAI_BUILD_VERBOSE") == "1",
        )
    except Exception as err:  # a compiler or linker failure: report it, and fall back
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise KernelsUnavailable(
            f"building the fused kernels failed: {first_line} (ASTRAI_BUILD_VERBOSE=1 shows the compiler output)"
        ) from err


def available() -> bool:
    """True when the fused kernels run on this machine (computed once; may build them on first call)."""
    if _override.value is not None:
        return _override.value
    try:
        load()
    except KernelsUnavailable:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, or None when they can."""
    if _override.value is False:
        return "turned off by override_available(False)"
    try:
        load()
    except KernelsUnavailable as err:
        return str(err)
    return None


def forced() -> bool | None:
    """The value set by override_available, or None when the flag is detected."""
    return _override.value


@contextlib.contextmanager
def override_available(value: bool | None) -> Iterator[None]:
    """Force the flag inside the block: False runs the references everywhere; True runs the kernels and
    raises KernelsUnavailable where they cannot run (CPU tensors, no build); None restores detection."""
    with _override(value):
        yield


def log_fallback(op: str, reason: str) -> None:
    """One log line per process, the first time an op runs its PyTorch reference instead of a kernel."""
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        log.info(
            "astrai_pl.ops: %s runs the PyTorch reference (%s); later fallbacks are not logged", op, reason
        )
