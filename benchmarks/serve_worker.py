"""One side of bench_serve.py's offline duel, in a process of its own (vLLM's side under vLLM's own venv):

    python benchmarks/serve_worker.py {ours,ours-loop,vllm} MODEL_DIR

answers one JSON line per request line on stdin ({"prompts", "max_tokens", "logprobs"} or {"op": "quit"})
with the run's tokens, log-probabilities, wall time and the CPU time of its whole process tree.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # astrai_pl from this checkout, in any venv

MAX_MODEL_LEN = 2048
THREADS = 2


# -- clocks ---------------------------------------------------------------------------------------------
def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and every descendant alive now, from /proc."""
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


# -- the workers (each side in a process of its own) ----------------------------------------------------
def our_generator(model_dir: str, threads: int, loop: bool = False) -> Callable:
    """`Engine.generate` stepping the batch on the calling (main) thread, or with `loop` on the engine's
    background loop thread, as `astrai-pl serve` runs it. The package is imported before harness (which
    imports torch), so its OMP_WAIT_POLICY=PASSIVE reaches OpenMP as it does under every `astrai-pl` verb:
    torch loaded first leaves libgomp busy-waiting, and stepping on the main thread then ran up to 10x slower
    on 2 shared cores."""
    # isort: off
    import astrai_pl  # noqa: F401
    from harness import setup
    # isort: on

    setup(threads)
    from astrai_pl.inference import Engine, SamplingParams
    from astrai_pl.model import Transformer

    engine = Engine(Transformer.from_pretrained(model_dir).eval(), page_size=16)
    if loop:
        engine.start()

    def generate(prompts, max_tokens: int, logprobs: bool):
        engine.reset_prefix_cache()  # every run computes every prompt; the weights' copies stay
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
        outs = engine.generate(prompts, params)
        return [list(o.token_ids) for o in outs], [list(o.logprobs) for o in outs] if logprobs else None

    return generate


def vllm_generator(model_dir: str, threads: int) -> Callable:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)

    def generate(prompts, max_tokens: int, logprobs: bool):
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                logprobs=0 if logprobs else None)
        outs = [o.outputs[0] for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                                   params, use_tqdm=False)]
        lps = [[step[t].logprob for step, t in zip(o.logprobs, o.token_ids)] for o in outs] if logprobs else None
        return [list(o.token_ids) for o in outs], lps

    return generate


def serve_as_worker(kind: str, model_dir: str, threads: int) -> None:
    """Answer one JSON line per request line on stdin; everything the libraries print goes to stderr."""
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if kind == "vllm":
        generate = vllm_generator(model_dir, threads)
    else:
        generate = our_generator(model_dir, threads, loop=kind == "ours-loop")
    answer.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            wall, cpu = time.perf_counter(), tree_cpu(os.getpid())
            tokens, logprobs = generate(request["prompts"], request["max_tokens"], request["logprobs"])
            reply = dict(wall=time.perf_counter() - wall, cpu=tree_cpu(os.getpid()) - cpu, tokens=tokens,
                         logprobs=logprobs)
        except Exception as err:  # the parent reports it and stops this worker
            reply = {"error": f"{type(err).__name__}: {err}"}
        answer.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve_as_worker(sys.argv[1], sys.argv[2], int(os.environ.get("OMP_NUM_THREADS") or THREADS))
