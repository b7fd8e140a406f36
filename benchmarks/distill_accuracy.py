"""Held-out accuracy of the distillation example: the larger SFT'd teacher, the `tiny` student trained by SFT
alone, the same student trained by SFT for as many more steps as the distillation takes (the control), and the
student distilled from the teacher (GKD), on the arithmetic problems no stage trained on (greedy answers, exact
match). The runs come first (the teacher about 70 minutes of one CPU core, the rest a few minutes each):

    astrai-pl fit --config configs/pretrain/tiny.yaml          # the student's starting point (make demo, stage 1)
    astrai-pl fit --config configs/sft/tiny.yaml               # the student by SFT alone
    astrai-pl fit --config configs/sft/teacher-small.yaml      # the teacher
    astrai-pl fit --config configs/distill/tiny.yaml           # the student distilled from it, 200 steps at 1e-4
    astrai-pl fit --config configs/sft/tiny.yaml --model.init_args.init_from runs/sft-tiny/latest/checkpoints/last.ckpt \
        --trainer.max_steps 200 --trainer.val_check_interval 200 --model.init_args.optimizer.init_args.lr 1e-4 \
        --trainer.default_root_dir runs/sft-more                # the control: 200 more SFT steps at 1e-4
    python benchmarks/distill_accuracy.py

(Run the control after the distillation: both start from runs/sft-tiny/latest.) `--dry-run` runs the same code
on fresh random `debug` models and a handful of problems (a test does this).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_pl.checkpoint import load_transformer  # noqa: E402
from astrai_pl.data.sources import Arithmetic  # noqa: E402
from astrai_pl.model import ModelConfig, Transformer  # noqa: E402
from astrai_pl.objectives import greedy_accuracy  # noqa: E402
from astrai_pl.sweep import text_table  # noqa: E402
from astrai_pl.tokenizer import Tokenizer  # noqa: E402

# option: (what it is, the checkpoint its config writes)
RUNS = {"teacher": ("teacher (SFT, 384 wide, 6 layers)", "runs/sft-teacher-small/latest/checkpoints/last.ckpt"),
        "sft": ("tiny by SFT alone", "runs/sft-tiny/latest/checkpoints/last.ckpt"),
        "sft_more": ("tiny by SFT, 200 steps more", "runs/sft-more/latest/checkpoints/last.ckpt"),
        "distilled": ("tiny distilled (GKD)", "runs/distill-tiny/latest/checkpoints/last.ckpt")}
# the held-out problems of configs/sft/tiny.yaml and configs/distill/tiny.yaml (same task, same seed)
TASK = Arithmetic(train_rows=20000, test_rows=200, ops=["+", "-"], max_operand=14, held_out_fraction=0.1)


def accuracies(paths: dict[str, str], n: int) -> list[list]:
    """[name, held-out accuracy, path] of each model."""
    tokenizer, problems = Tokenizer.byte_level(), TASK.problems("test", 0, n)
    rows = []
    for name, path in paths.items():
        model = load_transformer(None, path).eval()
        rows.append([name, greedy_accuracy(model, tokenizer, problems), path])
    return rows


def dry_run_paths(folder: Path) -> dict[str, str]:
    """Fresh random debug models saved as Hugging Face directories, one per entry of RUNS."""
    paths = {}
    for i, (name, _) in enumerate(RUNS.values()):
        torch.manual_seed(i)
        path = folder / f"model{i}"
        Transformer(ModelConfig.from_name("debug")).save_pretrained(path, tokenizer=Tokenizer.byte_level())
        paths[name] = str(path)
    return paths


def main(argv: list[str] | None = None) -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=200, help="held-out problems to answer")
    parser.add_argument("--dry-run", action="store_true", help="random debug models, 4 problems")
    for option, (name, path) in RUNS.items():
        parser.add_argument(f"--{option.replace('_', '-')}", default=path, help=f"checkpoint or Hugging Face directory of: {name}")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        if args.dry_run:
            rows = accuracies(dry_run_paths(Path(folder)), 4)
        else:
            paths = {name: getattr(args, option) for option, (name, _) in RUNS.items()}
            missing = [p for p in paths.values() if not Path(p).exists()]
            if missing:
                parser.error(f"no model at {', '.join(missing)}: run the stages in this script's docstring first")
            rows = accuracies(paths, args.problems)
    print(text_table(["model", "held-out accuracy", "weights"], rows))
    return rows


if __name__ == "__main__":
    main()
