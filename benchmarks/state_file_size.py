"""Bytes of a saved RWKV state after 10 and 2,000 tokens, and the logit error a compressed round trip costs.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/state_file_size.py [--presets rwkv-debug rwkv-tiny]

Each preset's weights are its initialisation plus Normal(0, 0.1) noise (so the state depends on the text).
For each context length and dtype the warm state is saved and loaded, then the same 32 probe tokens are read
from the original and from the loaded state; the error is the largest |Δlogit| over those 32 positions and
the vocabulary, beside the largest |logit| for scale.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from astrai_pl.inference import StateSession
from astrai_pl.model import ModelConfig, Transformer

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def jittered(preset: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(preset))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def measure(preset: str, folder: Path) -> None:
    model = jittered(preset)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    probe = torch.randint(3, vocab, (1, 32), generator=gen)
    for length in (10, 2000):
        chat = StateSession.warm(model, torch.randint(3, vocab, (length,), generator=gen).tolist())
        with torch.no_grad():
            want = model(probe, cache=chat.fork().state).logits
        for dtype in DTYPES:
            path = folder / f"{preset}-{length}-{dtype}.safetensors"
            chat.save(path, dtype=dtype)
            loaded = StateSession.load(path, model)
            with torch.no_grad():
                got = model(probe, cache=loaded.state).logits
            error = float((want - got).abs().max())
            print(f"| {preset} | {length} | {str(dtype).removeprefix('torch.')} | {path.stat().st_size} | "
                  f"{chat.nbytes} | {error:.2e} | {float(want.abs().max()):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["rwkv-debug", "rwkv-tiny"])
    args = parser.parse_args()
    print("| preset | context tokens | dtype | file bytes | state bytes in memory | max abs Δlogit | max abs logit |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            measure(preset, Path(tmp))


if __name__ == "__main__":
    main()
