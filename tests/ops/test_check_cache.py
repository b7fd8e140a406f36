"""`python -m astrai_pl.ops.check` compiles a step again only when its command, source, headers or compiler
changed: a passed step's object is cached under ASTRAI_CACHE_DIR, a failed one never is."""

from __future__ import annotations

import sys

import pytest

from astrai_pl.ops import check


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cuda-check"


def compiler(tmp_path, ok: bool = True) -> list[str]:
    """A stand-in compiler: counts its runs in `runs` and writes `out.o` (or fails)."""
    code = ("import sys; open(sys.argv[1], 'a').write('x'); "
            + ("open(sys.argv[2], 'w').write('object')" if ok else "sys.exit('error: bad source')"))
    return [sys.executable, "-c", code, str(tmp_path / "runs"), str(tmp_path / "out.o")]


def runs(tmp_path) -> int:
    return len((tmp_path / "runs").read_text()) if (tmp_path / "runs").is_file() else 0


def test_a_passed_step_is_not_run_again_and_its_object_comes_back(tmp_path, cache):
    command, output = compiler(tmp_path), tmp_path / "out.o"
    assert check.run_cached(command, output, "k1")[0] and runs(tmp_path) == 1
    output.unlink()
    ok, seconds, text = check.run_cached(command, output, "k1")
    assert (ok, seconds, text) == (True, 0.0, "(cached)") and runs(tmp_path) == 1
    assert output.read_text() == "object"
    assert check.run_cached(command, output, "k2")[0] and runs(tmp_path) == 2  # another key compiles
    assert check.run_cached(command, output, None)[0] and runs(tmp_path) == 3  # --no-cache compiles


def test_a_failed_step_is_run_again(tmp_path, cache):
    command, output = compiler(tmp_path, ok=False), tmp_path / "out.o"
    assert not check.run_cached(command, output, "k")[0]
    assert not check.run_cached(command, output, "k")[0] and runs(tmp_path) == 2
    assert not cache.exists() or not list(cache.iterdir())


def test_the_key_follows_source_headers_flags_and_compiler_but_not_the_output_path(tmp_path):
    source, header = tmp_path / "k.cu", tmp_path / "common.cuh"
    source.write_text("kernel")
    header.write_text("v1")

    def key(flag: str = "-O3", out: str = "a.o", version: str = "12.0") -> str:
        output = tmp_path / out
        return check.step_key(["nvcc", flag, "-o", str(output), str(source)], source, output, version)

    first = key()
    assert key(out="b.o") == first
    assert key(flag="-O2") != first and key(version="13.0") != first
    header.write_text("v2")
    assert key() != first
    header.write_text("v1")
    source.write_text("kernel 2")
    assert key() != first


def test_another_clone_of_the_same_sources_finds_the_key(tmp_path):
    keys = []
    for clone in ("one", "two"):
        cuda = tmp_path / clone / "cuda"
        cuda.mkdir(parents=True)
        (cuda / "k.cu").write_text("kernel")
        (cuda / "common.cuh").write_text("v1")
        source, output = cuda / "k.cu", tmp_path / clone / "k.o"
        command = ["nvcc", f"-I{cuda}", f"-I{sys.prefix}/include", "-o", str(output), str(source)]
        keys.append(check.step_key(command, source, output, "13.0"))
    assert keys[0] == keys[1]  # `make test` in a fresh clone does not compile the kernels again
