"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A decode step (every request adds its one next token) of n requests runs the graph of the smallest bucket
b >= n, from 1, 2, 4, 8, … up to max_batch_size (`batch_buckets`). The graph was recorded once over static
buffers (`DecodeInputs`): token ids, positions, the slot each new K/V goes to, each request's req_to_token row
(its page table) and its context length, all in one (5, max_batch_size) int64 block that a step refills with
one copy. Rows n … b-1 are padding: token 0 at position 0, one token of context read through row 0 of the
table (always valid slot numbers), and their K/V written to `pad_slot`, a slot of a page the graphs hold for
themselves; their logits are never read. Replaying launches every kernel of the forward at once: no Python per
layer, no launch latency, and nothing in the recorded region waits for the host (`GraphView.attend` reads
lengths and page tables from the buffers, never with `.item()`).

Prefill chunks and steps that mix them with decodes run eagerly, as do models whose rotary angles depend on the
sequence (longrope, dynamic NTK): those need host-side lengths.

Attention inside a graph: on the `cuda` backend the paged decode kernel, told the longest context the pool can
hold (`max_kv_len`), so the grid stays fixed while each request's length is read on the device. On any other
backend a gather of every request's whole table row (max_context slots) with a length mask; a bucket whose
gather would exceed `GATHER_BYTES` runs eagerly instead.

Memory: graphs share one private memory pool, so their cost is about that of the largest bucket's step (its
activations and (b, vocab) logits). The Engine takes an estimate of it (`reserve_bytes`) out of the GPU memory
the KV pool is sized from, records every bucket right after building the pool, and logs what capture measured.

Without CUDA the same bookkeeping runs with `RecordedStep` in place of a CUDA graph (it reruns the recorded
callable over the same buffers): that is how the tests check it on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .attention.backends import select_backend
from .pool import EngineConfigError
from .sampling import to_device

log = logging.getLogger(__name__)

GATHER_BYTES = 256 * 1024**2  # K/V a bucket's gather attention may copy per layer, beyond that: eager


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, … below max_batch_size, then max_batch_size itself."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows (None: more rows than the largest)."""
    return next((b for b in buckets if b >= n), None)


class DecodeInputs:
    """The static buffers every decode graph reads: one (5, max_batch_size) int64 block on the device."""

    FIELDS = ("ids", "positions", "out_slots", "rows", "kv_lens")

    def __init__(self, max_batch_size: int, device: torch.device, pad_slot: int):
        self.block = torch.zeros(len(self.FIELDS), max_batch_size, dtype=torch.int64, device=device)
        self.pad_slot = pad_slot
        self.fill([], [], [], [], [], max_batch_size)

    def padded(self, ids, positions, out_slots, rows, kv_lens, bucket: int) -> torch.Tensor:
        """(5, bucket) on the host: each list, then padding rows (token 0 at position 0, K/V to the pad slot,
        row 0 of the table, one token of context)."""
        pad = bucket - len(ids)
        assert pad >= 0, f"{len(ids)} rows do not fit a bucket of {bucket}"
        return torch.tensor([
            list(ids) + [0] * pad, list(positions) + [0] * pad, list(out_slots) + [self.pad_slot] * pad,
            list(rows) + [0] * pad, list(kv_lens) + [1] * pad,
        ], dtype=torch.int64)  # fmt: skip

    def fill(self, ids, positions, out_slots, rows, kv_lens, bucket: int) -> None:
        """Write one step's rows, padded to `bucket`, with one copy to the device (no wait on it)."""
        host = self.padded(ids, positions, out_slots, rows, kv_lens, bucket)
        self.block[:, :bucket].copy_(to_device(host, self.block.device), non_blocking=True)

    def view(self, bucket: int) -> dict[str, torch.Tensor]:
        """The first `bucket` columns of each buffer: fixed addresses, which a graph records."""
        return {name: self.block[i, :bucket] for i, name in enumerate(self.FIELDS)}


@dataclass
class GraphView:
    """The model's `cache=` inside a recorded decode step: everything it reads is a static buffer."""

    storage: object  # KVStorage
    req_to_token: torch.Tensor  # (rows, max_context) int32
    out_slots: torch.Tensor  # (b,) int64
    rows: torch.Tensor  # (b,) int64
    kv_lens: torch.Tensor  # (b,) int64: context length of each row, its new token included
    kernel: bool  # the fused paged decode kernel, else a masked gather of whole table rows

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
        """Store k, v (1, b, Hkv, D) at the buffers' slots; q (1, b, Hq, D) attends over each row's context."""
        _, b, Hq, D = q.shape
        self.storage.write(layer_idx, self.out_slots, k.reshape(b, -1, D), v.reshape(b, -1, D))
        q = q.reshape(b, Hq, D)
        if self.kernel:
            assert window is None and softcap is None, "the fused decode kernel does neither windows nor soft-caps"
            out = self._kernel(layer_idx, q, scale)
        else:
            out = gathered_decode(q, self.storage.k[layer_idx], self.storage.v[layer_idx], self.req_to_token,
                                  self.rows, self.kv_lens, window, scale, softcap)  # fmt: skip
        return out.view(1, b, Hq, D)

    def _kernel(self, layer_idx: int, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        from .. import ops

        indptr = torch.zeros(len(self.kv_lens) + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = self.kv_lens.cumsum(0)
        return ops.paged_decode(q, self.storage.k[layer_idx], self.storage.v[layer_idx], indptr,
                                req_to_token=self.req_to_token, rows=self.rows, scale=scale,
                                max_kv_len=self.req_to_token.shape[1])  # fmt: skip


def gathered_decode(
    q: torch.Tensor,  # (b, Hq, D)
    k_pool: torch.Tensor,  # (slots, Hkv, D)
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,  # (rows, W) int32
    rows: torch.Tensor,  # (b,) int64
    kv_lens: torch.Tensor,  # (b,) int64
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(s)·V with s = q·Kᵀ·scale (capped: c·tanh(s/c)) over keys j < kv_len (and j > kv_len-1-window),
    K, V gathered through whole table rows: shapes fixed by b and W alone. Returns (b, Hq, D)."""
    b, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    slots = req_to_token[rows].to(torch.int64)  # (b, W)
    k = k_pool[slots].transpose(1, 2)  # (b, Hkv, W, D)
    v = v_pool[slots].transpose(1, 2)
    scores = q.view(b, Hkv, Hq // Hkv, D).float() @ k.float().transpose(-1, -2)  # (b, Hkv, G, W)
    scores = scores * (D**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    at = torch.arange(slots.shape[1], device=q.device)
    keep = at[None] < kv_lens[:, None]  # (b, W)
    if window is not None:
        keep &= at[None] > kv_lens[:, None] - 1 - window
    scores = scores.masked_fill(~keep[:, None, None], float("-inf"))
    out = scores.softmax(dim=-1) @ v.float()  # (b, Hkv, G, D)
    return out.reshape(b, Hq, D).to(q.dtype)


# -- recording and replaying --------------------------------------------------------------------------------
class RecordedStep:
    """A stand-in for a CUDA graph on any device: recording runs the step once; replaying runs it again over the
    same buffers and writes the result into the same output tensor, as a graph's replay would."""

    def __init__(self, step: Callable[[], torch.Tensor], pool=None):
        self.step = step
        self.output = step()

    def replay(self) -> None:
        self.output.copy_(self.step())


class CudaStep:
    """`step` recorded into a CUDA graph (after one warm-up run on a side stream, as PyTorch asks)."""

    def __init__(self, step: Callable[[], torch.Tensor], pool=None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # lazy initialisation, kernel selection and allocations happen outside the recording
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a server thread using CUDA meanwhile does not invalidate the recording
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.output = step()

    def replay(self) -> None:
        self.graph.replay()


def graphable(model) -> str | None:
    """None when the model's decode step can be recorded, else why not."""
    rotary = getattr(model, "rotary", None)
    rope_type = getattr(model.config, "rope_type", None)
    if rope_type in ("longrope", "dynamic") or getattr(rotary, "per_sequence", False):
        return f"rope_type {rope_type!r} reads sequence lengths on the host"
    if getattr(model.config, "mixer", "attention") == "rwkv":
        return "a recurrent model has no paged decode step"
    if getattr(model.config, "num_experts", 0):
        return "mixture-of-experts routing reads its expert assignments on the host"
    return None


class RecordingFailed(RuntimeError):
    """A decode step could not be recorded; the runner runs decode steps eagerly from then on."""


def reserve_bytes(cfg, max_batch_size: int, dtype: torch.dtype) -> int:
    """An estimate of the recorded steps' memory, taken out of what sizes the KV pool: the largest bucket's
    logits (the projection's output, its float32 copy and the replay's copy of it) and a generous handful of
    float32 activations per token, plus 64 MiB for the graphs themselves. Capture logs what it measured."""
    b = max_batch_size
    logits = b * cfg.vocab_size * (dtype.itemsize + 8)
    width = 4 * cfg.hidden_size + 3 * cfg.intermediate_size
    width += (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_size
    return logits + 8 * b * width * 4 + 64 * 1024**2


class DecodeGraphs:
    """The recorded decode steps of one runner, by (bucket, attention through the kernel or a gather)."""

    def __init__(self, model, pool, max_batch_size: int, record: type | None = None):
        self.model, self.pool = model, pool
        self.buckets = batch_buckets(max_batch_size)
        if pool.available() < 2:
            raise EngineConfigError(f"a KV pool of {pool.num_pages} page(s) has none to spare for the decode graphs' "
                                    "padding rows; raise max_total_tokens or pass cuda_graphs=False")
        self.pages = pool.allocate(1)  # held for good: the padding rows' K/V go here
        device = pool.storage.k.device
        self.inputs = DecodeInputs(self.buckets[-1], device, self.pages[0] * pool.page_size)
        self.record = record or (CudaStep if device.type == "cuda" else RecordedStep)
        self.mempool = torch.cuda.graph_pool_handle() if self.record is CudaStep else None
        self.graphs: dict[tuple[int, bool], object] = {}
        self.addresses = self._addresses()  # where the recordings read the weights
        self.failed: str | None = None  # why recording failed once: every step runs eagerly then
        self._logged: set[int] = set()

    def usable(self, n: int, kernel: bool) -> bool:
        """Whether a decode step of n rows can replay a graph (recorded already or now)."""
        bucket = bucket_for(n, self.buckets)
        if bucket is None or self.failed is not None:
            return False
        if kernel or self._gather_bytes(bucket) <= GATHER_BYTES:
            return True
        if bucket not in self._logged:
            self._logged.add(bucket)
            log.info("decode steps of %d rows run eagerly: their gathered K/V (%d MiB a layer) exceed %d MiB", bucket,
                     self._gather_bytes(bucket) >> 20, GATHER_BYTES >> 20)  # fmt: skip
        return False

    def run(self, ids, positions, out_slots, rows, kv_lens, kernel: bool) -> torch.Tensor:
        """Logits (n, V) float32 of one decode step of n = len(ids) rows: fill the buffers, replay its bucket."""
        bucket = bucket_for(len(ids), self.buckets)
        self.inputs.fill(ids, positions, out_slots, rows, kv_lens, bucket)
        graph = self.graphs.get((bucket, kernel)) or self._record(bucket, kernel)
        graph.replay()
        return graph.output[: len(ids)].clone()  # the next replay overwrites the output

    def record_all(self, kernel: bool) -> int:
        """Record every usable bucket now, the largest first (later ones reuse its memory); returns how many."""
        done = 0
        for bucket in reversed(self.buckets):
            if (bucket, kernel) not in self.graphs and self.usable(bucket, kernel):
                self.inputs.fill([], [], [], [], [], bucket)  # padding only: writes reach the pad slot alone
                self._record(bucket, kernel)
                done += 1
        return done

    def _record(self, bucket: int, kernel: bool):
        try:
            graph = self.graphs[bucket, kernel] = self.record(self._step(bucket, kernel), self.mempool)
        except RuntimeError as err:  # e.g. an operation that syncs with the host while capturing
            self.failed = f"recording the decode step of {bucket} rows failed: {err}"
            self.graphs.clear()
            log.warning("decode steps run eagerly from now on: %s", self.failed)
            raise RecordingFailed(self.failed) from err
        return graph

    def follow_weights(self) -> bool:
        """After a change to the weights: forget every recording if a parameter or buffer lives elsewhere now
        (changes in place reach the recordings as they are); buckets are recorded again on use. Whether it did."""
        addresses = self._addresses()
        if addresses == self.addresses:
            return False
        self.graphs.clear()
        self.addresses = addresses
        return True

    def _addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def _gather_bytes(self, bucket: int) -> int:
        k = self.pool.storage.k
        return 2 * bucket * self.pool.req_to_token.max_context * k.shape[2] * k.shape[3] * k.element_size()

    def _step(self, bucket: int, kernel: bool) -> Callable[[], torch.Tensor]:
        buffers = self.inputs.view(bucket)
        view = GraphView(self.pool.storage, self.pool.req_to_token.table, buffers["out_slots"], buffers["rows"],
                         buffers["kv_lens"], kernel)  # fmt: skip
        ids, positions, model = buffers["ids"][None], buffers["positions"][None], self.model

        def step() -> torch.Tensor:  # (bucket, V) float32
            hidden, _ = model.hidden_states(ids, position_ids=positions, cache=view)
            return model.lm_head(hidden[0]).float()

        return step


# -- the Engine's side ---------------------------------------------------------------------------------------
def graphs_wanted(cuda_graphs: bool | None, model, device: torch.device, contiguous: bool = False) -> bool:
    """Whether an Engine records its decode steps: `cuda_graphs` (default: on CUDA), if the model and the pool's
    layout allow (a contiguous pool's page is a whole context: too much to hold for padding rows)."""
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda"
    if not cuda_graphs:
        return False
    if device.type != "cuda":
        raise EngineConfigError(f"Engine cuda_graphs=True needs a CUDA device, the engine is on {device}; "
                                "leave cuda_graphs unset")  # fmt: skip
    why = "the contiguous layout has no page to spare for padding rows" if contiguous else graphable(model)
    if why is not None:
        log.info("decode steps run eagerly: %s", why)
    return why is None


def record_decode_graphs(runner, pool, max_batch_size: int, reserved: int) -> DecodeGraphs:
    """Record every bucket's decode step for `runner` now and log the memory it took against `reserved`."""
    graphs = DecodeGraphs(runner.model, pool, max_batch_size)
    kernel = select_backend(runner.device, runner.dtype, runner.needs).name == "cuda"
    before = torch.cuda.memory_reserved(runner.device)
    try:
        with torch.inference_mode():
            count = graphs.record_all(kernel)
    except RecordingFailed:
        return graphs  # logged; it refuses every step from now on
    used = torch.cuda.memory_reserved(runner.device) - before
    log.info("CUDA graphs: %d decode steps recorded (batch sizes %s), %d MiB measured against %d MiB reserved",
             count, graphs.buckets, used >> 20, reserved >> 20)  # fmt: skip
    return graphs
