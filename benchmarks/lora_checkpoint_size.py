"""Bytes of a LoRA run's checkpoint against a full fine-tune's, on the same model and data.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lora_checkpoint_size.py [--preset small] [--r 16]

A base with random weights is written as a Hugging Face directory; two one-step runs start from it
(`init_from`), one training every weight, one an all-linear LoRA adapter (lora_alpha = 2·r); each saves
`last.ckpt` with AdamW's state. The LoRA checkpoint holds the adapter and its optimizer state (the base is read
again from init_from on resume), the full one every weight and two AdamW moments of each.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from astrai_pl.callbacks import read_checkpoint
from astrai_pl.model import LoraConfig, ModelConfig, Transformer
from astrai_pl.objectives import Pretrain


class RandomTokens(L.LightningDataModule):
    def __init__(self, vocab_size: int, seq_len: int = 64):
        super().__init__()
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def train_dataloader(self):
        ids = torch.randint(3, self.vocab_size, (1, 2, self.seq_len), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=None)


def checkpoint_of(module: Pretrain, folder: Path, vocab_size: int) -> Path:
    """One optimizer step of `module`, then its last.ckpt in `folder`."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)])
    trainer.fit(module, datamodule=RandomTokens(vocab_size))
    return folder / "last.ckpt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model preset (ModelConfig.from_name)")
    parser.add_argument("--r", type=int, default=16, help="rank of the all-linear adapter")
    args = parser.parse_args()
    config = ModelConfig.from_name(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        Transformer(config).save_pretrained(root / "base")
        lora = LoraConfig(r=args.r, lora_alpha=2 * args.r, target_modules="all-linear")
        runs = {"full fine-tune": Pretrain(init_from=str(root / "base")),
                f"LoRA r={args.r} all-linear": Pretrain(init_from=str(root / "base"), lora=lora)}
        sizes = {}
        for i, (name, module) in enumerate(runs.items()):
            trained = module.num_trainable_parameters()
            path = checkpoint_of(module, root / f"ckpt{i}", config.vocab_size)
            weights = len(read_checkpoint(path)["state_dict"])
            sizes[name] = (path.stat().st_size, trained, weights)
    full = next(iter(sizes.values()))[0]
    print(f"\npreset {args.preset}: last.ckpt after one AdamW step")
    print(f"{'run':<26}{'bytes':>14}{'MiB':>10}{'trained params':>16}{'weights in ckpt':>17}{'ratio':>9}")
    for name, (size, trained, weights) in sizes.items():
        print(f"{name:<26}{size:>14,}{size / 2**20:>10.2f}{trained:>16,}{weights:>17}{size / full:>9.4f}")


if __name__ == "__main__":
    main()
