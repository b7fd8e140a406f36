"""ProgressLines: plain lines with the step, the loss, tokens/s and an ETA, a few per run and one at its end."""

import re

import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.callbacks.progress import ProgressLines, batch_tokens, clock, rate
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import Pretrain

LINE = re.compile(r"^\[tiny\] step (\d+)/10 \((\d+)%\) \| train/loss [\d.]+ \| [\d.]+k? tokens/s \| "
                  r"elapsed \d+:\d\d \| ETA \d+:\d\d$")


def test_a_tiny_run_prints_a_line_every_fifth_of_its_steps_then_a_summary(capsys):
    torch.manual_seed(1)
    ids = torch.randint(3, 320, (10, 2, 16))
    data = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=None)
    progress = ProgressLines(name="tiny", every_fraction=0.2, every_seconds=None)
    trainer = quiet_trainer(max_steps=10, callbacks=[progress])
    trainer.fit(Pretrain(arch=ModelConfig.from_name("debug")), train_dataloaders=data)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[tiny]")]
    assert all(LINE.match(line) for line in lines[:-1]), lines
    assert [int(LINE.match(line)[1]) for line in lines[:-1]] == [2, 4, 6, 8]  # the last step: the summary
    assert re.fullmatch(r"\[tiny\] done: 10 steps in \d+:\d\d, [\d.]+k? tokens/s", lines[-1]), lines[-1]
    assert progress.summary.steps == 10 and progress.summary.tokens == 10 * 2 * 16


def test_a_line_also_comes_when_the_time_is_up(capsys):
    ids = torch.randint(3, 320, (3, 2, 16))
    data = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=None)
    trainer = quiet_trainer(max_steps=3, callbacks=[ProgressLines(name="tiny", every_fraction=1.0,
                                                                  every_seconds=1e-9)])
    trainer.fit(Pretrain(arch=ModelConfig.from_name("debug")), train_dataloaders=data)
    steps = re.findall(r"^\[tiny\] step (\d)/3", capsys.readouterr().out, re.MULTILINE)
    assert steps == ["1", "2"]


def test_tokens_are_the_real_ones_of_every_side():
    pad = 0
    ids = torch.tensor([[5, 6, 7, pad, pad], [5, 6, 7, 8, 9]])
    labels = torch.tensor([[-100, 6, 7, -100, -100], [-100, 6, 7, 8, 9]])
    batch = {"chosen_input_ids": ids, "chosen_labels": labels, "rejected_input_ids": ids, "rejected_labels": labels}
    assert int(batch_tokens(batch, pad)) == 2 * 8
    assert batch_tokens({"prompt_ids": [[1, 2]]}, pad) is None


def test_clock_and_rate_read_as_people_write_them():
    assert [clock(7), clock(754), clock(3723), clock(float("inf"))] == ["0:07", "12:34", "1:02:03", "?"]
    assert [rate(812), rate(21_400), rate(1_250_000)] == ["812", "21.4k", "1.25M"]


@pytest.mark.parametrize("kwargs, message", [({"every_fraction": 0}, "every_fraction=0"),
                                             ({"every_seconds": -1}, "every_seconds=-1")])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProgressLines(**kwargs)
