"""Decode steps replayed from recordings: buckets, padding, static buffers, no host sync in the step, and the
same tokens as eager steps. On CPU a `RecordedStep` stands in for the CUDA graph; the cuda-marked tests record
real graphs."""

import dataclasses

import pytest
import torch

from astrai_pl.inference import Engine, EngineConfigError, SamplingParams
from astrai_pl.inference.attention.backends import attn_backend
from astrai_pl.inference.decode_graphs import (
    DecodeGraphs,
    DecodeInputs,
    RecordedStep,
    batch_buckets,
    bucket_for,
    gathered_decode,
    graphable,
)
from astrai_pl.model import ModelConfig

GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)


def test_buckets_double_up_to_the_largest_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(n, batch_buckets(48)) for n in (1, 3, 4, 5, 33, 48, 49)] == [1, 4, 4, 8, 48, 48, None]


def test_a_step_fills_the_static_buffers_in_place_and_pads_to_its_bucket():
    inputs = DecodeInputs(8, torch.device("cpu"), pad_slot=99)
    addresses = {name: t.data_ptr() for name, t in inputs.view(4).items()}
    inputs.fill([5, 6, 7], [10, 3, 0], [40, 41, 42], [2, 0, 1], [11, 4, 1], bucket=4)
    view = inputs.view(4)
    assert {name: t.data_ptr() for name, t in view.items()} == addresses  # a graph recorded these addresses
    assert view["ids"].tolist() == [5, 6, 7, 0]
    assert view["positions"].tolist() == [10, 3, 0, 0]
    assert view["out_slots"].tolist() == [40, 41, 42, 99]  # the padding row writes to the pad slot only
    assert view["rows"].tolist() == [2, 0, 1, 0]
    assert view["kv_lens"].tolist() == [11, 4, 1, 1]
    with pytest.raises(AssertionError, match="do not fit"):
        inputs.fill([1, 2, 3], [0, 0, 0], [1, 2, 3], [0, 1, 2], [1, 1, 1], bucket=2)


def _reference(q, k_pool, v_pool, table, rows, kv_lens, window, scale, softcap):
    out = []
    for i in range(q.shape[0]):
        n = int(kv_lens[i])
        lo = 0 if window is None else max(0, n - window)
        slots = table[rows[i], lo:n].long()
        k = k_pool[slots].repeat_interleave(q.shape[1] // k_pool.shape[1], dim=1)  # (n, Hq, D)
        s = torch.einsum("hd,nhd->hn", q[i], k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v_pool[slots].repeat_interleave(2, dim=1)))
    return torch.stack(out)


@pytest.mark.parametrize("window, softcap", [(None, None), (3, None), (None, 5.0), (4, 2.0)])
def test_gathered_attention_reads_each_context_as_its_length_says(window, softcap):
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(64, 2, 8, generator=g), torch.randn(64, 2, 8, generator=g)
    table = torch.randperm(64, generator=g)[:48].view(3, 16).to(torch.int32)
    q = torch.randn(4, 4, 8, generator=g)
    rows, kv_lens = torch.tensor([2, 0, 1, 0]), torch.tensor([9, 16, 1, 5])
    got = gathered_decode(q, k_pool, v_pool, table, rows, kv_lens, window, 0.3, softcap)
    want = _reference(q, k_pool, v_pool, table, rows, kv_lens, window, 0.3, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _graphed(engine: Engine, record=RecordedStep) -> DecodeGraphs:
    engine.runner.graphs = DecodeGraphs(engine.model, engine.pool, engine.scheduler.max_batch_size, record)
    return engine.runner.graphs


def _ragged_run(engine: Engine, prompts) -> list:
    params = [dataclasses.replace(GREEDY, max_tokens=m, logprobs=True) for m in (9, 3, 6, 1, 7)]
    return engine.generate(prompts, params)


def test_replayed_decode_steps_give_the_eager_tokens_and_logprobs(model, make_engine, random_prompts):
    prompts = random_prompts([7, 12, 3, 20, 9], seed=3)
    eager = _ragged_run(make_engine(model, page_size=4, max_batch_size=8), prompts)
    engine = make_engine(model, page_size=4, max_batch_size=8)
    graphs = _graphed(engine)
    graphed = _ragged_run(engine, prompts)
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    # the prefill samples every first token (and ends max_tokens=1); then 4, 3 (padded to 4), 2 and 1 rows decode
    assert {bucket for bucket, _ in graphs.graphs} == {4, 2, 1}
    assert engine.check().in_use == 1  # only the padding rows' page stays held


class StrictStep(RecordedStep):
    """Replays with every way of reading a tensor on the host, or of making one from host data, refused."""

    READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def replay(self) -> None:
        refused = {name: getattr(torch.Tensor, name) for name in self.READS}
        made = torch.tensor

        def refuse(*args, **kwargs):
            raise AssertionError("the recorded step synchronised with the host")

        try:
            for name in self.READS:
                setattr(torch.Tensor, name, refuse)
            torch.tensor = refuse
            super().replay()
        finally:
            torch.tensor = made
            for name, method in refused.items():
                setattr(torch.Tensor, name, method)


def test_the_recorded_step_never_reads_a_tensor_on_the_host(model, make_engine, random_prompts):
    prompts = random_prompts([7, 12, 3, 20, 9], seed=4)
    engine = make_engine(model, page_size=4, max_batch_size=8)
    graphs = _graphed(engine, StrictStep)
    eager = _ragged_run(make_engine(model, page_size=4, max_batch_size=8), prompts)
    assert [c.token_ids for c in _ragged_run(engine, prompts)] == [c.token_ids for c in eager]
    assert graphs.graphs
    checked = StrictStep(lambda: torch.ones(2))
    checked.step = lambda: torch.ones(2) * torch.zeros(1).item()  # the checker itself catches a read
    with pytest.raises(AssertionError, match="synchronised"):
        checked.replay()


def test_a_windowed_soft_capped_model_replays_through_the_gather(wide_model, make_engine, random_prompts):
    config = dataclasses.replace(ModelConfig.from_name("debug"), sliding_window=5, attn_logit_softcapping=30.0)
    model = wide_model(config)
    prompts = random_prompts([7, 12, 3, 20, 9], seed=5)
    eager = _ragged_run(make_engine(model, page_size=4, max_batch_size=8), prompts)
    engine = make_engine(model, page_size=4, max_batch_size=8)
    graphs = _graphed(engine)
    assert [c.token_ids for c in _ragged_run(engine, prompts)] == [c.token_ids for c in eager]
    assert graphs.graphs and not any(kernel for _, kernel in graphs.graphs)


def test_graphs_on_a_cpu_engine_are_refused_by_name(model):
    with pytest.raises(EngineConfigError, match="cuda_graphs=True needs a CUDA device"):
        Engine(model, max_total_tokens=256, cuda_graphs=True)
    assert Engine(model, max_total_tokens=256).runner.graphs is None


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cuda_graphs_give_the_eager_greedy_tokens_in_float32(wide_model, random_prompts, backend):
    model = wide_model(ModelConfig.from_name("debug"))  # its own copy: the Engine moves it to the GPU
    prompts = random_prompts([7, 12, 3, 20, 9], seed=6)
    runs = []
    for graphs in (False, True):
        engine = Engine(model, device="cuda", dtype=torch.float32, max_total_tokens=4096, max_batch_size=8,
                        page_size=4, cuda_graphs=graphs, debug=True)
        assert (engine.runner.graphs is not None) == graphs
        if backend == "auto":
            runs.append(_ragged_run(engine, prompts))
        else:
            with attn_backend(backend):
                runs.append(_ragged_run(engine, prompts))
    assert [c.token_ids for c in runs[1]] == [c.token_ids for c in runs[0]]
    graphs = engine.runner.graphs
    assert graphs.graphs  # the decode steps did replay graphs
    slot = engine.pool.allocate(1)[0] * engine.pool.page_size
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # filling the buffers and replaying never wait for the GPU
    try:
        with torch.inference_mode():
            logits = graphs.run([9, 10, 11], [0, 0, 0], [slot, slot + 1, slot + 2], [0, 1, 2], [1, 1, 1],
                                kernel=next(iter(graphs.graphs))[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (3, model.config.vocab_size)


def test_the_host_read_check_catches_a_model_that_syncs(wide_model, make_engine):
    """Mixture-of-experts routing reads expert ids on the host: the engine keeps such models eager, and the strict
    replay of a recorded step catches the read."""
    model = wide_model(dataclasses.replace(ModelConfig.from_name("debug"), num_experts=4, num_experts_per_tok=2))
    assert "mixture-of-experts" in graphable(model)
    engine = make_engine(model, page_size=4, max_batch_size=4)
    graphs = _graphed(engine, StrictStep)
    slot = engine.pool.allocate(1)[0] * engine.pool.page_size
    with torch.inference_mode(), pytest.raises(AssertionError, match="synchronised"):
        graphs.run([9, 10], [0, 0], [slot, slot + 1], [0, 1], [1, 1], kernel=False)


def test_a_failed_recording_leaves_decode_steps_eager(model, make_engine, random_prompts, caplog):
    class Failing(RecordedStep):
        def __init__(self, step, pool=None):
            raise RuntimeError("operation not permitted when stream is capturing")

    prompts = random_prompts([7, 12, 3, 20, 9], seed=7)
    eager = _ragged_run(make_engine(model, page_size=4, max_batch_size=8), prompts)
    engine = make_engine(model, page_size=4, max_batch_size=8)
    graphs = _graphed(engine, Failing)
    assert [c.token_ids for c in _ragged_run(engine, prompts)] == [c.token_ids for c in eager]
    assert "not permitted" in graphs.failed and not graphs.graphs
    assert "decode steps run eagerly" in caplog.text


def test_serve_enforce_eager_turns_the_graphs_off(monkeypatch):
    from astrai_pl import commands
    from astrai_pl.serve.cli import serve_parser

    made = []
    monkeypatch.setattr(commands, "load_adapted", lambda model, adapter: _Loaded())
    monkeypatch.setattr(commands, "load_tokenizer", lambda path: type("T", (), {"vocab_size": 8})())
    monkeypatch.setattr(commands, "Engine", lambda *args, **kwargs: made.append(kwargs))
    for flags, want in (([], None), (["--enforce-eager"], False)):
        commands.load_engine(serve_parser().parse_args(["--model", "m", "--tokenizer", "byte", *flags]))
        assert made.pop()["cuda_graphs"] is want


class _Loaded:
    lora_config = None
    config = type("C", (), {"vocab_size": 8})()

    def eval(self):
        return self


def test_a_pool_without_a_page_to_spare_is_refused_by_name(model, make_engine):
    engine = make_engine(model, page_size=4, max_total_tokens=4)
    with pytest.raises(EngineConfigError, match="raise max_total_tokens or pass cuda_graphs=False"):
        _graphed(engine)


def test_recordings_follow_weights_that_move_and_keep_those_changed_in_place(wide_model, make_engine, random_prompts):
    model = wide_model(ModelConfig.from_name("debug"), seed=2)
    prompts = random_prompts([7, 12, 3, 20, 9], seed=9)
    engine = make_engine(model, page_size=4, max_batch_size=8)
    graphs = _graphed(engine)
    _ragged_run(engine, prompts)
    recorded = dict(graphs.graphs)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place: the recordings read the new values where they are
    engine.weights_changed()
    assert graphs.graphs == recorded
    assert [c.token_ids for c in _ragged_run(engine, prompts)] == [
        c.token_ids for c in _ragged_run(make_engine(model, page_size=4, max_batch_size=8), prompts)
    ]
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 3.0)  # elsewhere now
    engine.weights_changed()
    assert not graphs.graphs
    assert [c.token_ids for c in _ragged_run(engine, prompts)] == [
        c.token_ids for c in _ragged_run(make_engine(model, page_size=4, max_batch_size=8), prompts)
    ]


def test_the_graphs_reserve_comes_out_of_the_pools_share(monkeypatch):
    from astrai_pl.inference.decode_graphs import reserve_bytes
    from astrai_pl.inference.pool import default_total_tokens

    cfg = ModelConfig.from_name("debug")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 1024**3, 16 * 1024**3))
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_size * dtype.itemsize
    reserve = reserve_bytes(cfg, 256, dtype)
    assert reserve > 256 * cfg.vocab_size * (dtype.itemsize + 4)  # at least the largest bucket's logits
    full, less = default_total_tokens(cfg, cuda, dtype), default_total_tokens(cfg, cuda, dtype, reserve)
    assert full - less == pytest.approx(reserve / per_token, abs=1)
