"""GRPO rollouts: our Engine against transformers' `generate` sampling the same groups on the same weights.

The `small` preset (~31M parameters), float32, 2 threads. 8 prompts of 48…144 tokens, a group of 4
completions each, 64 new tokens per completion (end-of-sequence ignored, so both sides generate exactly
8 x 4 x 64 tokens), temperature 1, no top-k / top-p:

- ours: `Engine.generate(prompts, SamplingParams(n=4, logprobs=True, …))`, as `objectives/rollout.py`
  samples: the 4 samples of a prompt fork from its prefilled K/V, and every sample's log-probabilities
  come back with it;
- transformers: `generate(num_return_sequences=4, do_sample=True)` on the whole batch, left-padded,
  as a generate-based GRPO trainer samples (it repeats each prompt 4 times and prefills each copy).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_rollout.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import command_line, duel, emit, hf_copy, row_from, save, setup, small_model  # noqa: E402

from astrai_pl.inference import Engine, SamplingParams  # noqa: E402


def prompts_of(count: int, shortest: int, longest: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(shortest, longest, count).round().int().tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=9, help="timed rollouts per side, interleaved")
    parser.add_argument("--budget", type=float, default=80, help="seconds after which no new round starts "
                        "(at least 3 rounds)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    setup()
    model = small_model().eval()
    hf = hf_copy(model)
    prompts = prompts_of(args.prompts, 48, 144, model.config.vocab_size)
    G, N = args.group_size, args.new_tokens
    engine = Engine(model, page_size=16)
    params = SamplingParams(max_tokens=N, temperature=1.0, n=G, ignore_eos=True, logprobs=True)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    counts = {}

    def ours():
        engine.weights_changed()  # fresh weights each rollout in training: no cached K/V, copies remade
        outs = engine.generate(prompts, params)
        counts["ours"] = sum(len(o.token_ids) for o in outs)

    @torch.inference_mode()
    def theirs():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=G,
                          max_new_tokens=N, min_new_tokens=N, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
        counts["peer"] = (out.shape[1] - width) * out.shape[0]

    engine.generate(prompts[:2], SamplingParams(max_tokens=4, n=G, ignore_eos=True))  # warm-up on a short job
    with torch.inference_mode():
        hf.generate(input_ids=ids[:2], attention_mask=mask[:2], do_sample=True, max_new_tokens=4, pad_token_id=0)
    result = duel(ours, theirs, args.reps, warmup=0, budget_s=args.budget)
    total = args.prompts * G * N
    assert counts["ours"] == counts["peer"] == total, f"unequal work: {counts}, expected {total}"
    measure = f"GRPO rollout, {args.prompts} prompts x {G} samples x {N} tokens"
    rows = [row_from(result, measure, "transformers generate", total, "tokens/s", command_line(), target=2.0)]
    emit(rows)
    save(rows, args.json)


if __name__ == "__main__":
    main()
