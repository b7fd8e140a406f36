"""The one run-time chooser behind every kernel/library choice: override in a block before force before the
environment before the device's default order; a named candidate that cannot run falls back to its stand-in or
the default order with one log line per reason; unknown names are refused."""

import logging

import pytest
import torch

from astrai_pl.ops.choice import Choice


def gpu_only(device, dtype):
    return None if device.type == "cuda" else f"needs CUDA, not {device.type}"


def make(**kwargs):
    return Choice("demo", {"ref": None, "fast": gpu_only, "exact": None}, {"cuda": ("fast", "ref"), "*": ("ref",)},
                  env="ASTRAI_DEMO_CHOICE", **kwargs)


def test_precedence_is_override_then_force_then_environment_then_default(monkeypatch):
    choice, cpu = make(), torch.device("cpu")
    assert choice.choose(cpu, torch.float32) == "ref"
    assert choice.choose(torch.device("cuda"), torch.float32) == "fast"  # checks only, nothing runs on the device
    monkeypatch.setenv("ASTRAI_DEMO_CHOICE", " Exact ")
    assert choice.choose(cpu, torch.float32) == "exact"
    choice.force("ref")
    assert choice.choose(cpu, torch.float32) == "ref"
    with choice.override("exact"):
        assert choice.choose(cpu, torch.float32) == "exact"
        with choice.override(None):
            assert choice.choose(cpu, torch.float32) == "ref"
    choice.force(None)
    assert choice.choose(cpu, torch.float32) == "exact"


def test_a_named_choice_that_cannot_run_falls_back_with_one_line_per_reason(caplog):
    plain, stood_in, cpu = make(), make(stand_ins={"fast": "exact"}), torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="astrai_pl"):
        for _ in range(2):
            with plain.override("fast"):
                assert plain.choose(cpu, torch.float32) == "ref"
            with stood_in.override("fast"):
                assert stood_in.choose(cpu, torch.float32) == "exact"
    assert [r.getMessage() for r in caplog.records] == ["astrai_pl: demo fast falls back (needs CUDA, not cpu)"] * 2


def test_unknown_names_are_refused(monkeypatch):
    choice = make()
    with pytest.raises(ValueError, match="demo 'fastest': choose one of ref, fast, exact"):
        choice.force("fastest")
    with pytest.raises(ValueError, match="ref, fast, exact"), choice.override("fastest"):
        pass
    monkeypatch.setenv("ASTRAI_DEMO_CHOICE", "fastest")
    with pytest.raises(ValueError, match="ASTRAI_DEMO_CHOICE='fastest' is not one of ref, fast, exact"):
        choice.choose(torch.device("cpu"), torch.float32)
