"""The engine on a GPU against transformers' `generate`, `astrai-pl serve` under the openai client, and the
attention kernels against SDPA: one script, one markdown table.

    python benchmarks/gpu_engine.py [--parts engine serve kernels] [--out FILE] [--hbm-gbs 4800]
    python benchmarks/gpu_engine.py --dry-run      # every code path on CPU, tiny shapes, in seconds

Parts:
- engine: the `Qwen2.5-0.5B` preset with random bfloat16 weights (seed 0), page size 16, greedy, end of
  sequence ignored. Workloads: 64 ragged prompts of 64-512 tokens x 128 new; 64 x (1,024 shared + 32 own)
  x 128 new (prefix cache on, emptied before each run); 16 x 4,000-token prompts x 64 new. Ours with the
  cuda backend and with the torch backend, and transformers' `generate` at its best setting (static cache,
  `torch.compile` of the forward; left-padded batches) on the first two. Output tokens/s of a warm run.
- serve: `astrai-pl serve` on the same preset (bfloat16), driven by the `openai` client's streaming
  completions at 32 and 128 concurrent streams (the ragged prompts, 128 new tokens each): tokens/s,
  time to first token and inter-token latency, p50 and p99.
- kernels: paged decode at 64 requests x 4,096 tokens (32 query / 8 kv heads, head_dim 128, bf16) as GB/s
  of K/V read and as a fraction of `--hbm-gbs` (H200: 4,800); each prefill implementation
  (`astrai_pl.ops.prefill`: sdpa, flex, flash where installed) against SDPA on contiguous K/V at 512 and
  4,096 tokens (8 requests).

`--dry-run` runs every part on CPU with the `debug` preset and a handful of tokens (no compile, two
streams), so a test can keep the script working; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "ops")]


@dataclass
class Shape:
    preset: str
    device: str
    dtype: torch.dtype
    scale: int  # divides every token count (1: the real workloads)
    streams: tuple[int, ...]
    compile_hf: bool
    reps: int  # timed runs after one warm-up (0: a single untimed-warm-up run is the measurement)


REAL = Shape("Qwen2.5-0.5B", "cuda", torch.bfloat16, 1, (32, 128), True, 3)
DRY = Shape("debug", "cpu", torch.float32, 64, (2,), False, 0)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int = 3) -> float:
    """Median seconds of `fn` over `reps` runs after one warm-up (reps 0: one run, no warm-up)."""
    if reps:
        fn()
    times = []
    for _ in range(max(reps, 1)):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- engine ---------------------------------------------------------------------------------------------------
def workloads(vocab: int, s: Shape) -> dict[str, tuple[list[list[int]], int]]:
    from bench_decode import make_prompts, shared_prefix_prompts

    n = max(64 // s.scale, 2)
    return {
        "64 ragged (64-512) x 128 new": (make_prompts(n, 64 // s.scale, 512 // s.scale, vocab, 0), 128 // s.scale),
        "64 x (1,024 shared + 32) x 128 new": (shared_prefix_prompts(vocab, n, 1024 // s.scale, 32 // s.scale),
                                               128 // s.scale),
        "16 x 4,000 x 64 new": (make_prompts(max(16 // s.scale, 2), 4000 // s.scale, 4000 // s.scale, vocab, 3),
                                64 // s.scale),
    }  # fmt: skip


def random_model(s: Shape):
    from astrai_pl.model import ModelConfig, Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig.from_name(s.preset)).to(device=s.device, dtype=s.dtype).eval()


def ours(model, backend: str, prompts, new: int, s: Shape) -> float:
    from astrai_pl.inference import Engine, SamplingParams
    from astrai_pl.inference.attention.backends import attn_backend

    with attn_backend(backend):
        # a fixed pool (1.6 GB at the 0.5B shape) that holds the largest workload: no engine takes 80% of the GPU
        engine = Engine(model, page_size=16, max_total_tokens=131_072 // s.scale)
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

        def run():
            engine.reset_prefix_cache()
            engine.generate(prompts, params)

        return timed(run, s.device, reps=min(s.reps, 2))


def hf_generate(model, prompts, new: int, s: Shape) -> float:
    """transformers' generate, static cache, the forward compiled (its documented fastest setting)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=s.dtype, attn_implementation="sdpa").to(s.device)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    if s.compile_hf:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=s.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=s.device)

    def run():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        cache_implementation="static")  # fmt: skip

    return timed(run, s.device, reps=min(s.reps, 2))


def engine_part(s: Shape) -> list[str]:
    model = random_model(s)
    rows = ["| workload | ours, cuda backend | ours, torch backend | transformers `generate` (static cache + compile) |",
            "|---|---|---|---|"]  # fmt: skip
    backends = ("cuda", "torch") if s.device == "cuda" else ("torch",)
    for i, (name, (prompts, new)) in enumerate(workloads(model.config.vocab_size, s).items()):
        tokens = len(prompts) * new
        cells = {b: f"{tokens / ours(model, b, prompts, new, s):,.0f} tok/s" for b in backends}
        if s.device == "cuda":
            torch.cuda.empty_cache()  # the engines' pools, before transformers allocates its static cache
        hf = f"{tokens / hf_generate(model, prompts, new, s):,.0f} tok/s" if i < 2 else "—"
        rows.append(f"| {name} | {cells.get('cuda', 'no GPU')} | {cells['torch']} | {hf} |")
        print(rows[-1], flush=True)
    return rows


# -- serve ----------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


async def stream_load(url: str, key: str, prompts: list[str], streams: int, new: int) -> dict:
    """`2 × streams` streamed completions through the openai client, `streams` at a time."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=key, timeout=600, max_retries=0)
    todo, ttft, itl, tokens = list(range(2 * streams)), [], [], [0]

    async def one_stream():
        while todo:
            i = todo.pop()
            start = last = time.perf_counter()
            first = True
            stream = await client.completions.create(
                model="model", prompt=prompts[i % len(prompts)], max_tokens=new, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                words = len((chunk.choices[0].text if chunk.choices else "").split())
                if not words:
                    continue
                now = time.perf_counter()
                (ttft.append(now - start) if first else itl.append((now - last) / words))
                first, last, tokens[0] = False, now, tokens[0] + words

    start = time.perf_counter()
    await asyncio.gather(*(one_stream() for _ in range(streams)))
    await client.close()
    return dict(wall=time.perf_counter() - start, tokens=tokens[0], ttft=ttft, itl=itl)


def serve_part(s: Shape) -> list[str]:
    from bench_serve import write_model

    rows = ["| streams | tokens/s | TTFT p50 | TTFT p99 | inter-token p50 | inter-token p99 |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        vocab = write_model(s.preset, Path(folder))
        prompts = [" ".join(map(str, p)) for p in workloads(vocab, s)["64 ragged (64-512) x 128 new"][0]]
        new, port, key = 128 // s.scale, 8617, "bench-key"
        cmd = [sys.executable, "-m", "astrai_pl.cli", "serve", "--model", folder, "--port", str(port), "--api-key", key,
               "--served-model-name", "model", "--max-model-len", "2048", "--device", s.device,
               "--dtype", str(s.dtype).removeprefix("torch.")]  # fmt: skip
        server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            url = wait_ready(server, f"http://127.0.0.1:{port}", key)
            if s.reps:
                asyncio.run(stream_load(url, key, prompts, 2, new))  # warm-up
            for streams in s.streams:
                got = asyncio.run(stream_load(url, key, prompts, streams, new))
                ms = [1e3 * percentile(got["ttft"], 50), 1e3 * percentile(got["ttft"], 99),
                      1e3 * percentile(got["itl"], 50), 1e3 * percentile(got["itl"], 99)]  # fmt: skip
                rows.append(f"| {streams} | {got['tokens'] / got['wall']:,.0f} | " + " | ".join(f"{v:.1f} ms" for v in ms) + " |")
                print(rows[-1], flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    return rows


def wait_ready(server: subprocess.Popen, url: str, key: str, timeout: float = 600) -> str:
    import httpx

    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"astrai-pl serve exited ({server.returncode}): {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"astrai-pl serve not ready after {timeout:.0f} s")


# -- kernels --------------------------------------------------------------------------------------------------
def decode_row(name: str, seconds: float, read: int, hbm_gbs: float) -> str:
    gbs = read / seconds / 1e9
    return f"| {name} | {seconds * 1e3:.3f} ms | {gbs:,.0f} GB/s ({gbs / hbm_gbs:.0%} of {hbm_gbs:,.0f}) |"


def library_decodes(batch: int, ctx: int, heads: tuple, read: int, hbm_gbs: float, s: Shape) -> list[str]:
    """FlashInfer / flash-attn decode on the same shape over a page-16 (flash-attn: 256) pool, where installed."""
    from astrai_pl.ops.decode_libs import DECODE_LIBS, why_not
    from astrai_pl.ops.prefill import PagedBatch

    rows = []
    for name, page_size in (("flashinfer", 16), ("flash", 256)):
        why = why_not(name, torch.device(s.device), s.dtype, page_size)
        if why:
            rows.append(f"| {name} decode {batch} x {ctx} | — | {why} |")
            continue
        pages = -(-ctx // page_size)
        order = torch.randperm(batch * pages, device=s.device).view(batch, pages, 1)
        table = (order * page_size + torch.arange(page_size, device=s.device)).view(batch, -1)[:, :ctx].int()
        k_pool, v_pool = (torch.randn(batch * pages * page_size, heads[1], heads[2], device=s.device, dtype=s.dtype)
                          for _ in range(2))  # fmt: skip
        q = torch.randn(batch, heads[0], heads[2], device=s.device, dtype=s.dtype)
        paged = PagedBatch([1] * batch, [ctx] * batch, table, page_size)
        args = (q, k_pool, v_pool, paged)
        took = timed(lambda f=DECODE_LIBS[name], a=args: f(*a), s.device, s.reps and 10)
        rows.append(decode_row(f"{name} decode {batch} x {ctx}", took, read, hbm_gbs))
    return rows


def kernel_part(s: Shape, hbm_gbs: float) -> list[str]:
    from paged_cases import paged_case

    from astrai_pl import ops
    from astrai_pl.ops.prefill import FLASH_ATTN_AVAILABLE, PREFILL, PagedBatch

    batch, ctx = (64, 4096) if s.scale == 1 else (2, 64)
    heads = (32, 8, 128) if s.scale == 1 else (4, 2, 64)
    case = paged_case([1] * batch, [ctx] * batch, *heads, s.dtype, s.device, seed=0)
    decode = timed(lambda: ops.paged_decode(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices,
                                            max_kv_len=ctx), s.device, reps=s.reps and 10)  # fmt: skip
    read = 2 * batch * ctx * heads[1] * heads[2] * case.k_pool.element_size()
    rows = [decode_row(f"decode {batch} x {ctx}", decode, read, hbm_gbs)]
    rows += library_decodes(batch, ctx, heads, read, hbm_gbs, s)
    rows += ["", "| prefill | tokens | ms | vs SDPA on contiguous K/V |", "|---|---|---|---|"]
    for tokens in (512, 4096) if s.scale == 1 else (16,):
        n = 8 if s.scale == 1 else 2
        case = paged_case([tokens] * n, [tokens] * n, *heads, s.dtype, s.device, seed=1)
        paged = PagedBatch([tokens] * n, [tokens] * n, case.kv_indices.view(n, tokens), 1)
        q = case.q.view(n, tokens, heads[0], heads[2]).transpose(1, 2)
        k, v = (pool[case.kv_indices].view(n, tokens, heads[1], heads[2]).transpose(1, 2).contiguous()
                for pool in (case.k_pool, case.v_pool))  # fmt: skip
        base = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                     s.device, s.reps)  # fmt: skip
        rows.append(f"| SDPA, contiguous K/V | {tokens} | {base * 1e3:.2f} | 1.00x |")
        for name, impl in PREFILL.items():
            if name == "flash" and (not FLASH_ATTN_AVAILABLE or s.device != "cuda"):
                rows.append(f"| {name} | {tokens} | — | flash_attn not installed here |")
                continue
            took = timed(lambda impl=impl, c=case, p=paged: impl(c.q, c.k_pool, c.v_pool, p), s.device, s.reps)
            rows.append(f"| {name} | {tokens} | {took * 1e3:.2f} | {base / took:.2f}x |")
    for row in rows:
        print(row, flush=True)
    return ["| kernel | time | K/V read |", "|---|---|---|", *rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every code path on CPU, tiny shapes")
    parser.add_argument("--parts", nargs="+", choices=("engine", "serve", "kernels"), default=["engine", "serve", "kernels"])
    parser.add_argument("--hbm-gbs", type=float, default=4800.0, help="the GPU's memory bandwidth, GB/s")
    parser.add_argument("--out", help="write the markdown tables here too")
    args = parser.parse_args(argv)
    s = DRY if args.dry_run else REAL
    if s.device == "cuda" and not torch.cuda.is_available():
        print("gpu_engine.py needs a CUDA device (or --dry-run)")
        return 2
    header = f"{torch.cuda.get_device_name() if s.device == 'cuda' else 'CPU dry run'}, torch {torch.__version__}"
    out = [f"# {header}", f"command: python benchmarks/gpu_engine.py {' '.join(sys.argv[1:] if argv is None else argv)}"]
    parts = {"engine": lambda: engine_part(s), "serve": lambda: serve_part(s),
             "kernels": lambda: kernel_part(s, args.hbm_gbs)}  # fmt: skip
    for part in args.parts:
        print(f"## {part}", flush=True)
        out += ["", f"## {part}", *parts[part]()]
    if args.out:
        Path(args.out).write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
