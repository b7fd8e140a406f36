"""Distill (GKD) with a teacher we load: the sequences of each source, the loss against both models' full
distributions, a few training steps, and its option errors. The server teacher: tests/serve/test_distill_teacher.py."""

import dataclasses

import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.callbacks.progress import ProgressLines, batch_tokens
from astrai_pl.data import Arithmetic, GRPOData
from astrai_pl.data.packing import IGNORE_INDEX
from astrai_pl.data.synthetic import problems
from astrai_pl.model import ConfigError, ModelConfig, Transformer
from astrai_pl.objectives import Distill
from astrai_pl.objectives.distill import reference_completion_ids
from astrai_pl.objectives.evaluation import chat_prompts
from astrai_pl.objectives.on_policy_losses import generalized_jsd_loss
from astrai_pl.tokenizer import Tokenizer

TOKENIZER = Tokenizer.byte_level()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("teacher")
    arch = dataclasses.replace(ModelConfig.from_name("debug"), num_hidden_layers=3)  # a bigger model than the student
    Transformer(arch).save_pretrained(path, tokenizer=TOKENIZER)
    return str(path)


def distill(teacher_dir, **kw):
    torch.manual_seed(0)
    kw.setdefault("arch", ModelConfig.from_name("debug"))
    kw.setdefault("max_new_tokens", 6)
    return Distill(tokenizer=TOKENIZER, teacher_model=teacher_dir, **kw)


def logits_of(model, ids):
    out = model(ids)
    return getattr(out, "logits", out)  # (B, T, V)


def prompt_batch(n=3, seed=0) -> dict[str, list]:
    ps = problems(n, "train", seed)
    return {"prompt": [[{"role": "user", "content": p.question}] for p in ps], "answer": [p.answer for p in ps],
            "prompt_ids": chat_prompts([p.question for p in ps], TOKENIZER)}


def test_a_reference_completion_is_the_assistant_turn_the_chat_template_writes():
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = reference_completion_ids(TOKENIZER, prompt, "5")
    assert TOKENIZER.decode(ids) == "5<|im_end|>"
    assert reference_completion_ids(TOKENIZER, "2 + 3 =", "5") == [*TOKENIZER.encode("5"), TOKENIZER.eos_token_id]


@pytest.mark.parametrize("lmbda, seq_kd, expected", [(1.0, False, "student"), (0.0, True, "teacher"),
                                                      (0.0, False, "data")])
def test_each_step_continues_the_prompts_by_its_source(teacher_dir, lmbda, seq_kd, expected):
    module = distill(teacher_dir, lmbda=lmbda, seq_kd=seq_kd)
    assert module.source("train") == expected and module.source("val") == "data"
    batch = prompt_batch()
    part = module.sequences(batch, expected)
    for row, labels, prompt in zip(part["input_ids"], part["labels"], batch["prompt_ids"]):
        assert row[: len(prompt)].tolist() == prompt and (labels[: len(prompt)] == IGNORE_INDEX).all()
        completion = row[labels != IGNORE_INDEX].tolist()
        if expected == "data":
            assert TOKENIZER.decode(completion).startswith(batch["answer"][batch["prompt_ids"].index(prompt)])
        if expected == "teacher":  # the teacher's greedy continuation
            with torch.no_grad():
                first = logits_of(module.teacher.model, torch.tensor([prompt]))[0, -1].argmax().item()
            assert completion[0] == first


def test_the_loss_is_the_generalised_jsd_of_both_models_full_distributions(teacher_dir):
    module = distill(teacher_dir, lmbda=0.0, beta=0.3)
    batch = prompt_batch()
    loss, metrics = module._shared_step(batch, "train")
    part = module.sequences(batch, "data")
    targets = torch.cat([part["labels"][:, 1:], torch.full_like(part["labels"][:, :1], IGNORE_INDEX)], 1)
    with torch.no_grad():
        expected, _ = generalized_jsd_loss(logits_of(module.model, part["input_ids"]),
                                           logits_of(module.teacher.model, part["input_ids"]),
                                           targets, beta=0.3)
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-5)
    assert loss.item() > 0 and metrics["tokens"].item() == (targets != IGNORE_INDEX).sum().item()
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.model.parameters())
    assert all(p.grad is None for p in module.teacher.model.parameters())


def test_distill_trains_a_few_steps_toward_the_teacher(tmp_path, teacher_dir):
    module = distill(teacher_dir, lmbda=0.5, beta=0.5, optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3))
    batch = prompt_batch(4, seed=1)
    with torch.no_grad():
        before = module._shared_step(batch, "val")[0].item()
    data = GRPOData(synthetic=Arithmetic(train_rows=100, test_rows=10), batch_size=4, cache_dir=str(tmp_path))
    trained, sequences = [], module.sequences

    def recorded(batch, source):  # the real tokens of each step's sequences, as trained
        part = sequences(batch, source)
        trained.append(int(batch_tokens(part, module.model.config.pad_token_id)))
        return part

    module.sequences = recorded
    progress = ProgressLines(name="distill", every_fraction=1.0, every_seconds=None)
    quiet_trainer(devices=1, max_steps=8, limit_val_batches=0, callbacks=[progress]).fit(module, datamodule=data)
    del module.sequences
    with torch.no_grad():
        after = module._shared_step(batch, "val")[0].item()
    assert after < before  # the divergence to the teacher on held-out sequences went down
    assert len(trained) == 8 and progress.summary.tokens == sum(trained) > 0  # its tokens/s counts what it trained on
    assert not any(k.startswith("teacher") for k in module.state_dict())  # checkpoints hold the student only


@pytest.mark.parametrize("kw, message", [
    ({}, "give exactly one"),
    ({"teacher_model": "x", "teacher_url": "http://127.0.0.1:1"}, "give exactly one"),
    ({"teacher_url": "http://127.0.0.1:1", "seq_kd": True}, r"Distill\.seq_kd=True: needs teacher_model"),
    ({"teacher_url": "http://127.0.0.1:1", "lmbda": 1.5}, r"Distill\.lmbda=1\.5"),
    ({"teacher_url": "http://127.0.0.1:1", "beta": -0.1}, r"Distill\.beta=-0\.1"),
])
def test_bad_options_are_config_errors_naming_them(kw, message):
    with pytest.raises(ConfigError, match=message):
        Distill(arch=ModelConfig.from_name("debug"), tokenizer=TOKENIZER, **kw)


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path):
    arch = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=400)
    Transformer(arch).save_pretrained(tmp_path, tokenizer=TOKENIZER)
    with pytest.raises(ConfigError, match="vocab_size=400"):
        _ = Distill(arch=ModelConfig.from_name("debug"), tokenizer=TOKENIZER, teacher_model=str(tmp_path)).teacher


def test_the_accuracy_comparison_dry_runs(capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "distill_accuracy.py"
    spec = importlib.util.spec_from_file_location("distill_accuracy", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--dry-run"])
    assert [r[0] for r in rows] == [name for name, _ in module.RUNS.values()]
    assert all(0.0 <= r[1] <= 1.0 for r in rows) and "held-out accuracy" in capsys.readouterr().out
