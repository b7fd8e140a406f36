"""The options every objective takes are declared once, on Objective, and still reach each objective whole."""

import pytest
from jsonargparse import ArgumentParser

from astrai_pl import config_reference
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import DPO, GRPO, SFT, Pretrain

ARCH = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
SHARED = ["arch", "init_from", "tokenizer", "optimizer", "scheduler", "activation_checkpointing", "compile"]
OWN = {Pretrain: "label_smoothing", SFT: "label_smoothing", DPO: "beta", GRPO: "num_generations"}


@pytest.mark.parametrize("cls", OWN)
def test_saved_hyperparameters_hold_the_shared_options_with_their_defaults(cls):
    module = cls(arch=ARCH)
    assert module.hparams["init_from"] is None and module.hparams["arch"] == ARCH
    assert module.hparams["activation_checkpointing"] == "none" and module.hparams["compile"] is False
    assert OWN[cls] in module.hparams
    assert not {"tokenizer", "optimizer", "scheduler"} & set(module.hparams)


@pytest.mark.parametrize("cls", OWN)
def test_configs_and_the_reference_document_every_shared_option(cls):
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "model")
    helps = {a.dest: a.help for a in parser._actions}
    for name in [*SHARED, OWN[cls]]:
        assert helps.get(f"model.{name}"), name
    documented = {a.name: a.doc for a in config_reference.arguments(cls)}
    assert all(documented.get(name) for name in [*SHARED, OWN[cls]])


def test_a_sixth_positional_argument_is_refused_not_bound_to_another_option():
    assert Pretrain(ARCH).arch.hidden_size == 32  # the first five stay positional
    with pytest.raises(TypeError):
        Pretrain(ARCH, None, None, None, None, 0.1)
