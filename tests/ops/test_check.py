"""`python -m astrai_pl.ops.check` fails on a warning in our files, in device or host code."""

from __future__ import annotations

import shutil

import pytest

from astrai_pl.ops import check

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

KERNEL = "__global__ void fill(float* x) { x[threadIdx.x] = 1.f; }\n"


@pytest.mark.parametrize(
    "extra,clean",
    [
        ("", True),
        ("__global__ void unused_local(float* x) { int y; x[0] = 1.f; }\n", False),  # device code
        ("int unused_parameter(int a) { return 1; }\n", False),  # host code, -Wextra
    ],
)
def test_nvcc_step_fails_on_warnings(tmp_path, extra, clean):
    source = tmp_path / "probe.cu"
    source.write_text(KERNEL + extra)
    ok, _, output = check.run(check.nvcc_command(source, shutil.which("nvcc"), tmp_path / "probe.o"))
    assert ok is clean, output
