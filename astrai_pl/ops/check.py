"""Compile every kernel source without a GPU, failing on any error or warning in our files.

    python -m astrai_pl.ops.check [--verbose]

Each .cu in cuda/ goes through nvcc for sm_80 and sm_90 (-c, nothing run) with the flags torch's
extension builder adds (no implicit half/bfloat16 conversions) and host and device warnings as errors, and ptxas told to fail on register spills or local-memory use; the binding
(bindings.cpp) goes through the host C++ compiler against torch's headers, which are included as system
headers so that only warnings in our files count. Then every launcher the binding calls must be defined
by one of the kernel objects (nm), so a signature that drifted between launchers.h and a .cu fails here
rather than at import on a GPU machine. One line per step; exit status 1 when any step fails or a tool
is missing.

A step that passed is not compiled again: its object file is kept in `ASTRAI_CACHE_DIR` (default
`~/.cache/astrai_pl`, as the CPU kernels) under `cuda-check/`, named by a hash of its command, its source, every
header in cuda/, torch's and the compiler's versions, so only a changed source, header, flag or toolkit rebuilds
(a failed step is never kept); the checkout's and the Python environment's folders are left out of the hash, so
a fresh clone of the same sources compiles nothing again. `--no-cache` compiles everything.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .build import EXTENSION_NAME, cuda_dir
from .cpu import _cache_dir

ARCHS = ("80", "90")


def nvcc_command(source: Path, nvcc: str, output: Path, verbose: bool = False) -> list[str]:
    """nvcc -c with torch's own extension flags (no implicit half/bfloat16 conversions, as in the real build)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    ptxas = "-v,-warn-spills,-warn-lmem-usage" if verbose else "-warn-spills,-warn-lmem-usage"
    return [
        nvcc, "-c", "-std=c++17", "-O3", *COMMON_NVCC_FLAGS, *gencode, f"-I{source.parent}",
        "-Xcompiler", "-Wall,-Wextra,-Werror", "--Werror", "all-warnings", "-Xptxas", ptxas,
        "-o", str(output), str(source),
    ]  # fmt: skip


def binding_command(source: Path, cxx: str, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    system = [*include_paths(), sysconfig.get_paths()["include"]]
    return [
        cxx, "-std=c++17", "-c", "-O0", "-fPIC", "-Wall", "-Wextra", "-Werror", "-o", str(output),
        f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}", f"-I{source.parent}",
        *[arg for path in system for arg in ("-isystem", path)], str(source),
    ]  # fmt: skip


def run(command: list[str]) -> tuple[bool, float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    return done.returncode == 0, time.perf_counter() - start, (done.stdout + done.stderr).strip()


def tool_version(tool: str) -> str:
    """The first lines of `tool --version` (part of every cache key: a new toolkit rebuilds everything)."""
    done = subprocess.run([tool, "--version"], capture_output=True, text=True, errors="replace", timeout=60)
    return done.stdout.strip()


def torch_version() -> str:
    import torch

    return torch.__version__


def step_key(command: list[str], source: Path, output: Path, version: str) -> str:
    """The hash that names a step's cached object: its command (the temporary output path left out, and the
    checkout's and the Python environment's folders named by role, so another clone or virtual environment of
    the same sources and torch finds it), torch's version, the source, every header beside it and the
    compiler's version."""
    import torch

    places = ((str(source.parent.parent), "<checkout>"), (sys.prefix, "<prefix>"))
    digest = hashlib.sha256()
    for part in (*(arg for arg in command if arg != str(output)), version, torch.__version__):
        for place, role in places:
            part = part.replace(place, role)
        digest.update(part.encode() + b"\0")
    for file in [source, *sorted(p for p in source.parent.iterdir() if p.suffix in (".h", ".cuh", ".hpp"))]:
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def run_cached(command: list[str], output: Path, key: str | None) -> tuple[bool, float, str]:
    """`run(command)`, unless the object of a passed step with this key is cached: then it is copied to
    `output` (the link check reads it) and the step takes no time. A passed step's object is cached."""
    cached = None if key is None else _cache_dir() / "cuda-check" / f"{key}.o"
    if cached is not None and cached.is_file():
        shutil.copyfile(cached, output)
        return True, 0.0, "(cached)"
    ok, seconds, text = run(command)
    if ok and cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f".{cached.name}.{os.getpid()}")
        shutil.copyfile(output, partial)
        os.replace(partial, cached)  # atomic: a concurrent check never reads half an object
    return ok, seconds, text


_NM_LINE = re.compile(r"^\s*(?:[0-9a-fA-F]+\s+)?[A-Za-z]\s+(astrai::.*)$", re.MULTILINE)


def symbols(objects: list[Path], flag: str) -> set[str]:
    """Demangled names in namespace astrai that the objects define (--defined-only) or need (--undefined-only)."""
    listing = subprocess.run(
        ["nm", "-C", flag, *map(str, objects)], capture_output=True, text=True, check=True
    )
    return {m.group(1) for m in _NM_LINE.finditer(listing.stdout)}


def check_link(binding: Path, kernels: list[Path]) -> tuple[bool, str]:
    if shutil.which("nm") is None:
        return True, "skipped: nm (binutils) not found"
    needed, defined = symbols([binding], "--undefined-only"), symbols(kernels, "--defined-only")
    missing = sorted(needed - defined)
    if missing:
        return False, "undefined in the kernel objects: " + "; ".join(missing)
    return True, f"the binding's {len(needed)} calls into the kernels resolve"


def report(results: dict, jobs: dict, binding: Path, folder: Path, verbose: bool) -> int:
    failed = 0
    for src, (ok, seconds, output) in results.items():
        what = "c++ against torch headers" if src == binding else "nvcc " + " ".join(f"sm_{a}" for a in ARCHS)
        took = "cached" if output == "(cached)" else f"{seconds:.1f} s"
        print(f"{'ok  ' if ok else 'FAIL'} {src.relative_to(folder.parent)}  ({what}, {took})")
        if verbose:
            print("     " + shlex.join(jobs[src]))
        if output and output != "(cached)" and (not ok or verbose):
            print("\n".join("     " + line for line in output.splitlines()))
        failed += not ok
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true",
                        help="print the commands and ptxas resource usage (compiles everything: nothing cached)")
    parser.add_argument("--no-cache", action="store_true", help="compile every step, even one that passed before")
    args = parser.parse_args(argv)
    folder = cuda_dir()
    nvcc = shutil.which("nvcc")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    kernels = sorted(folder.glob("*.cu"))
    binding = folder / "bindings.cpp"
    if nvcc is None or cxx is None or not kernels or not binding.is_file():
        print(f"cuda-check: needs nvcc ({nvcc}), a C++ compiler ({cxx}) and the sources in {folder}")
        return 1
    with tempfile.TemporaryDirectory(prefix="cuda-check-") as tmp:
        objects = {src: Path(tmp) / f"{src.name}.o" for src in [*kernels, binding]}
        jobs = {src: nvcc_command(src, nvcc, objects[src], args.verbose) for src in kernels}
        jobs[binding] = binding_command(binding, cxx, objects[binding])
        # torch's headers are the binding's input too: its version joins the host compiler's
        versions = {nvcc: tool_version(nvcc), cxx: f"{tool_version(cxx)} torch {torch_version()}"}
        keys = [None if args.no_cache or args.verbose else step_key(job, src, objects[src], versions[job[0]])
                for src, job in jobs.items()]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            results = dict(zip(jobs, pool.map(run_cached, jobs.values(), [objects[s] for s in jobs], keys)))
        failed = report(results, jobs, binding, folder, args.verbose)
        if not failed:
            ok, message = check_link(objects[binding], [objects[src] for src in kernels])
            print(f"{'ok  ' if ok else 'FAIL'} link: {message}")
            failed += not ok
    print(f"cuda-check: {'passed' if not failed else f'{failed} step(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
