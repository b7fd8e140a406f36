"""lm-eval's multiple-choice task through AstraiLM (our engine) against lm-eval's own `hf` model, on CPU.

The same weights (the `small` preset, ~31M parameters, float32, 2 threads; saved as a Hugging Face directory
with the byte tokenizer) and the same task: the shipped `astrai_next_sentence` (a context and four candidate
next sentences, scored by log-likelihood), `--limit` documents, through `lm_eval.simple_evaluate` end to end,
zero-shot and with few-shot examples (`--shots`: as MMLU or HellaSwag are run, where the shared context is
most of each request). The engine takes every request at once and prefills each context once for its four
choices (radix cache, reset before each run); the `hf` model runs padded batches of `--hf-batch`. Runs
alternate (harness.py); the ratio is the median of per-run ratios hf / ours. Also checks that both give the
same accuracy.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_eval.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, command_line, duel, emit, row_from, save, setup, small_model  # noqa: E402

from astrai_pl.evaluation import AstraiLM, evaluate  # noqa: E402
from astrai_pl.tokenizer import Tokenizer  # noqa: E402

TASK = "astrai_next_sentence"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8, help="documents of the task (4 requests each)")
    parser.add_argument("--shots", default="0,2", help="comma-separated few-shot counts, one row each")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="alternate runs of each; the median ratio counts")
    parser.add_argument("--budget", type=float, default=240, help="seconds after which no new round starts")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    setup(args.threads)
    from lm_eval.models.huggingface import HFLM

    with tempfile.TemporaryDirectory() as folder:
        small_model().save_pretrained(folder, tokenizer=Tokenizer.byte_level())
        ours = AstraiLM.from_pretrained(folder, device="cpu")
        peer = HFLM(pretrained=folder, device="cpu", batch_size=args.hf_batch, max_length=ours.max_length,
                    dtype="float32")
    rows = [measure(ours, peer, shots, args) for shots in map(int, args.shots.split(","))]
    save(rows, args.json)


def measure(ours: AstraiLM, peer, shots: int, args) -> Row:
    results = {}

    def run_ours():
        ours.engine.reset_prefix_cache()  # every run computes every context
        results["ours"] = evaluate(ours, [TASK], limit=args.limit, num_fewshot=shots)["results"][TASK]

    def run_peer():
        with torch.inference_mode():
            results["peer"] = evaluate(peer, [TASK], limit=args.limit, num_fewshot=shots)["results"][TASK]

    evaluate(ours, [TASK], limit=1, num_fewshot=shots)  # warm-up, both sides, on a short job
    evaluate(peer, [TASK], limit=1, num_fewshot=shots)
    before = ours.engine.stats
    result = duel(run_ours, run_peer, args.repeats, warmup=0, budget_s=args.budget)
    after, runs = ours.engine.stats, len(result.ours)
    computed = (after.prefill_tokens - before.prefill_tokens) // runs
    cached = (after.cached_tokens - before.cached_tokens) // runs
    row = row_from(result, f"lm-eval {TASK} {shots}-shot, {args.limit} documents x 4 choices",
                   f"lm-eval hf (batch {args.hf_batch})", args.limit, "documents/s", command_line(), target=2.0)
    same = results["ours"]["acc,none"] == results["peer"]["acc,none"]
    row.detail += (f"; acc {results['ours']['acc,none']:.3f} ours, {results['peer']['acc,none']:.3f} hf "
                   f"({'equal' if same else 'DIFFERENT'}); per run the engine computed {computed} tokens and "
                   f"took {cached} from the prefix cache")
    emit([row])
    return row


if __name__ == "__main__":
    main()
