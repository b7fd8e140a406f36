"""RWKV decoding in the engine: against transformers' RwkvForCausalLM.generate on the same weights, its cost per
token at a long and a short context beside the attention model's, and its state beside attention's K/V.

The `rwkv-tiny` preset (4 layers, width 192, float32, 2 threads), random weights, written with `save_pretrained`
and read back by transformers. Three rows:

1. 16 prompts of 32 random ids x 64 new tokens, greedy: our engine (`Engine.generate`, prefix cache off so
   every repetition computes its prompts) against `RwkvForCausalLM.generate` on the batch (equal lengths, so
   it needs no padding). The row says how many completions of each equal transformers' generate on one
   prompt at a time (its batched generate does not always agree with that).
2. Per-token decode time of one request at 4096 tokens of context over that at 64 (the median of 32 decode
   steps each, after the prefill), for RWKV and for the attention preset of the same width (`tiny`, its
   context raised to fit): a recurrent step costs the same at any length, attention's grows with it.
3. Bytes one request holds at 4096 tokens: the RWKV state (`engine.usage().state_bytes`) against the K/V of
   the attention preset (`bytes_per_token` x 4096).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_rwkv_decode.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, command_line, duel, emit, row_from, save, setup  # noqa: E402

from astrai_pl.inference import Engine, SamplingParams  # noqa: E402
from astrai_pl.model import ModelConfig, Transformer  # noqa: E402

LONG, SHORT, STEPS = 4096, 64, 32


def random_model(preset: str, **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(preset, **overrides)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 2 else 0.1))
    return model


def hf_copy(model):
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # every token is generated, as ignore_eos does
    hf.generation_config.pad_token_id = 0
    return hf


def against_generate(model, args) -> Row:
    hf = hf_copy(model)
    prompts = torch.randint(3, model.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine = Engine(model, max_batch_size=16, prefix_cache=False)

    def ours():
        return [o.token_ids for o in engine.generate(prompts.tolist(), params)]

    @torch.no_grad()
    def peer():
        return hf.generate(prompts, max_new_tokens=args.new_tokens, do_sample=False)[:, 32:].tolist()

    with torch.no_grad():  # the reference: transformers' generate on one prompt at a time
        alone = [hf.generate(p[None], max_new_tokens=args.new_tokens, do_sample=False)[0, 32:].tolist()
                 for p in prompts]
    mine, batched = ours(), peer()  # also the warm-up of both
    result = duel(ours, peer, args.repeats, warmup=0, budget_s=args.budget)
    row = row_from(result, f"RWKV greedy decode (rwkv-tiny, 16 prompts x {args.new_tokens} new tokens)",
                   "transformers RwkvForCausalLM.generate", 16 * args.new_tokens, "tokens/s", command_line(),
                   target=3.0)
    row.note = (f"ours equal transformers' generate of one prompt at a time on "
                f"{sum(a == b for a, b in zip(mine, alone))}/16 completions, its batched generate (timed) on "
                f"{sum(a == b for a, b in zip(batched, alone))}/16")
    return row


def per_token_decode(engine: Engine, context: int) -> float:
    """Median seconds of a decode step of one request with `context` tokens before it."""
    prompt = torch.randint(3, engine.model.config.vocab_size, (context,),
                           generator=torch.Generator().manual_seed(context)).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=STEPS + 2, temperature=0.0, ignore_eos=True))
    while not any(d.token_ids for d in engine.step()):
        pass  # the prefill
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort(rid)
    return statistics.median(times)


def constant_cost(rwkv, attention) -> list[Row]:
    engines = {"RWKV": Engine(rwkv, prefix_cache=False, max_total_tokens=2 * LONG, max_step_tokens=1024),
               "attention": Engine(attention, prefix_cache=False, max_total_tokens=2 * LONG, max_step_tokens=1024)}
    ratios, detail = {}, []
    for name, engine in engines.items():
        per_token_decode(engine, SHORT)  # warm-up
        short, long = per_token_decode(engine, SHORT), per_token_decode(engine, LONG)
        ratios[name] = long / short
        detail.append(f"{name} {long * 1e3:.2f} ms at {LONG}, {short * 1e3:.2f} ms at {SHORT}")
    text = f"RWKV {ratios['RWKV']:.2f}, attention {ratios['attention']:.2f} (target: RWKV <= 1.1)"
    cost = Row(f"decode time per token, {LONG} / {SHORT} tokens of context (width 192, 4 layers)",
               "the attention preset of the same width (tiny)", None, detail="; ".join(detail),
               command=command_line(), note=text)
    state = engines["RWKV"].usage().state_bytes
    kv = engines["attention"].pool.storage.bytes_per_token * LONG
    memory = Row(f"bytes per request at {LONG} tokens (width 192, 4 layers)",
                 "K/V of the attention preset of the same width (tiny)", kv / state,
                 detail=f"RWKV state {state} B (any length), attention K/V {kv} B", command=command_line(),
                 note="ratio: K/V bytes / state bytes")
    return [cost, memory]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=120, help="seconds after which no new round starts")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    setup(args.threads)
    rwkv = random_model("rwkv-tiny")
    attention = random_model("tiny", max_position_embeddings=2 * LONG)
    rows = [against_generate(rwkv, args)]
    emit(rows)
    rows += constant_cost(rwkv, attention)
    emit(rows[1:])
    save(rows, args.json)


if __name__ == "__main__":
    main()
