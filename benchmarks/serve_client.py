"""The online part's client: streamed /v1/completions requests against an OpenAI-compatible server (ours or
vLLM's), timed per token, and the figures a round of them gives. Shared by benchmarks/bench_serve.py."""

from __future__ import annotations

import asyncio
import json
import statistics
import time


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


async def stream_one(client, url: str, body: dict, headers: dict) -> tuple[float, list[float], int]:
    """One streamed completion: time to the first token, the gaps between later chunks, tokens received."""
    start = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            choices = json.loads(data).get("choices") or [{}]
            words = len((choices[0].get("text") or "").split())  # the tokenizer's words are its tokens
            if not words:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append((now - last) / words)
            last, tokens = now, tokens + words
    return (first if first is not None else float("nan")), gaps, tokens


async def load_round(url: str, model: str, prompts: list[str], concurrency: int, requests: int,
                     key: str | None, new_tokens: int) -> dict:
    """`requests` streamed completions of `new_tokens` each (end of sequence ignored), `concurrency` at a time:
    wall time, tokens received, every request's TTFT and every inter-token gap."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    todo = list(range(requests))
    ttft, itl, tokens = [], [], [0]

    async def client_loop(client):
        while todo:
            i = todo.pop()
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": new_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            first, gaps, got = await stream_one(client, url, body, headers)
            ttft.append(first)
            itl.extend(gaps)
            tokens[0] += got

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return dict(wall=wall, tokens=tokens[0], ttft=ttft, itl=itl)


def serving_figures(rs: list[dict]) -> str:
    ttft = [t for r in rs for t in r["ttft"]]
    itl = [g for r in rs for g in r["itl"]]
    tps = statistics.median(r["tokens"] / r["wall"] for r in rs)
    return (f"{tps:.1f} tokens/s, TTFT p50 {percentile(ttft, 50) * 1e3:.0f} ms p99 {percentile(ttft, 99) * 1e3:.0f} ms, "
            f"ITL p50 {percentile(itl, 50) * 1e3:.1f} ms p99 {percentile(itl, 99) * 1e3:.1f} ms")
