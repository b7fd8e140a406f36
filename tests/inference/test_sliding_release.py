"""Pages before every layer's window go back to the pool (every layer slides, as in Mistral): memory stays bounded
while a request generates many windows, and greedy tokens stay equal to transformers' `generate`."""

import pytest
import torch

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.ops import cpu as cpu_ops

transformers = pytest.importorskip("transformers")

PAGE = 4
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
SHORT, LONG = [5, 9, 30, 7, 2], list(range(20, 40))  # shorter and longer than the window


class Pair:
    """transformers' MistralForCausalLM on random weights and our Transformer loaded from its save."""

    def __init__(self, window: int, tmp_path):
        torch.manual_seed(0)
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=window)).eval()
        gen = torch.Generator().manual_seed(window)
        with torch.no_grad():  # wide weights: greedy decoding follows the context instead of repeating a token
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
        hf.generation_config.eos_token_id = None
        hf.save_pretrained(tmp_path)
        self.hf, self.window = hf, window
        self.model = Transformer.from_pretrained(tmp_path).eval()
        self._expected: dict = {}

    def expected(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._expected:
            with torch.no_grad():
                out = self.hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                       pad_token_id=0)
            self._expected[key] = out[0, len(prompt):].tolist()
        return self._expected[key]

    def engine(self, **kwargs) -> Engine:
        kwargs = {"page_size": PAGE, "max_total_tokens": 1024, **kwargs}
        return Engine(self.model, debug=True, **kwargs)  # debug: Engine.check() after every step

    @property
    def steady_pages(self) -> int:
        """Pages a decoding request holds: its window and the page being filled."""
        return -(-self.window // PAGE) + 1


@pytest.fixture(scope="module", params=[8, pytest.param(10, marks=pytest.mark.slow)], ids=["window8", "window10"])
def pair(request, tmp_path_factory):
    return Pair(request.param, tmp_path_factory.mktemp(f"mistral{request.param}"))


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)


def run_steps(engine: Engine, prompts, params) -> tuple[dict[str, list[int]], list[int]]:
    """Each request's tokens, and the pages in use after every step."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    in_use = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        in_use.append(engine.usage().in_use)
    return {i: tokens[i] for i in ids} if params.n == 1 else tokens, in_use


@pytest.mark.parametrize("kernels", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sdpa", "cpu-kernel"])
def test_pages_stay_bounded_over_ten_windows_and_greedy_equals_transformers(pair, kernels):
    max_tokens = 10 * pair.window
    with cpu_ops.override_available(kernels):
        engine = pair.engine()
        got, in_use = run_steps(engine, [SHORT, LONG], greedy(max_tokens))
    assert list(got.values()) == [pair.expected(SHORT, max_tokens), pair.expected(LONG, max_tokens)]
    # once the window has passed the prompts (published, so kept until then) each request holds its window
    # and the page being filled
    assert max(in_use[2 * pair.window:]) <= 2 * pair.steady_pages, in_use
    assert engine.scheduler.released_pages >= 2 * (max_tokens // PAGE - pair.steady_pages)
    assert engine.usage().evictable == len(LONG) // PAGE + len(SHORT) // PAGE  # the prompts stay cached
    assert engine.usage().in_use == 0


def test_released_slots_are_never_read(pair):
    """Freed pages are filled with NaN until they are handed out again: a gather that reached one, even masked
    out, would turn the logits to NaN. The SDPA path gathers the whole context, released positions included."""
    engine = pair.engine(prefix_cache=False, max_step_tokens=6)
    pool, storage = engine.pool, engine.pool.storage
    slide, allocate = pool.slide, pool.allocator.allocate

    def fill(pages, value):
        slots = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)], dtype=torch.int64)
        storage.k[:, slots] = value
        storage.v[:, slots] = value

    def poisoning_slide(pages, *args):
        before = list(pages)
        n = slide(pages, *args)
        fill([p for p, q in zip(before, pages) if p != q], float("nan"))
        return n

    def clean_allocate(n):
        pages = allocate(n)
        if pages:
            fill(pages, 0.0)
        return pages

    pool.slide, pool.allocator.allocate = poisoning_slide, clean_allocate
    max_tokens = 4 * pair.window
    with cpu_ops.override_available(False):
        [out] = engine.generate([LONG], greedy(max_tokens))
    assert out.token_ids == pair.expected(LONG, max_tokens)
    assert engine.scheduler.released_pages > 0


def test_chunked_prefill_releases_without_a_prefix_cache(pair):
    """Without the radix cache nothing waits for the prompt: its chunks slide past the window as they go."""
    engine = pair.engine(prefix_cache=False, max_step_tokens=3)
    prompt = LONG + SHORT  # 25 tokens in chunks of 3
    engine.add_request(prompt, greedy(2 * pair.window))
    tokens, released_at_first_token = [], None
    while engine.has_unfinished():
        for delta in engine.step():
            if not tokens:
                released_at_first_token = engine.scheduler.released_pages
            tokens += delta.token_ids
    assert released_at_first_token >= (len(prompt) - pair.window) // PAGE - 1
    assert tokens == pair.expected(prompt, 2 * pair.window)


def test_a_released_prompt_still_serves_the_prefix_cache(pair):
    """The prompt's pages are published before the request lets them go (kept, evictable, by the cache); the
    generated pages, released on the way, are never published."""
    engine = pair.engine()
    max_tokens = 4 * pair.window
    [first] = engine.generate([LONG], greedy(max_tokens))
    assert engine.pool.radix.num_cached_tokens == len(LONG) // PAGE * PAGE
    [again] = engine.generate([LONG], greedy(max_tokens))
    assert again.cached_tokens == (len(LONG) - 1) // PAGE * PAGE
    assert first.token_ids == again.token_ids == pair.expected(LONG, max_tokens)


def test_forks_share_the_prompt_and_release_their_own_pages(pair):
    """n samples start on the parent's pages (full ones shared) and release independently; sampling with a
    seed gives the tokens it gives with nothing released."""
    params = SamplingParams(max_tokens=4 * pair.window, temperature=1.0, n=3, seed=7, ignore_eos=True)
    engine, keeping = pair.engine(), pair.engine()
    keeping.pool.window = None  # the same engine, releasing nothing
    got, in_use = run_steps(engine, [LONG], params)
    kept, kept_in_use = run_steps(keeping, [LONG], params)
    assert got == kept and len(got) == 3
    assert max(in_use[2 * pair.window:]) <= 3 * pair.steady_pages < max(kept_in_use)
    assert engine.scheduler.released_pages > 0 and keeping.scheduler.released_pages == 0


def test_preempted_requests_recompute_and_release_again(pair):
    """A pool too small for three decoding requests preempts; a recompute of prompt and output publishes
    once past the prompt and releases again, and greedy tokens stay transformers'."""
    prompts = [SHORT, LONG[:6], LONG[6:12]]
    engine = pair.engine(max_total_tokens=8 * PAGE, max_step_tokens=8)
    max_tokens = 32 - 12  # the context is capped at the pool's size
    out = engine.generate(prompts, greedy(max_tokens))
    assert engine.stats.preemptions > 0 and engine.scheduler.released_pages > 0
    assert [c.token_ids for c in out] == [pair.expected(p, max_tokens) for p in prompts]


def test_session_turns_keep_every_page(pair, tmp_path):
    """A session keeps (and saves) its whole conversation; a plain request on the same tokens releases."""
    engine = pair.engine()
    chat = engine.session()
    reply = chat.generate(LONG, greedy(3 * pair.window))
    assert engine.scheduler.released_pages == 0
    assert chat.memory().pages == engine.pool.pages_for(chat.num_computed)
    history = LONG + reply.token_ids
    follow = [3, 4, 5]
    chat.save(tmp_path / "chat.safetensors")
    loaded = engine.load_session(tmp_path / "chat.safetensors")
    expected = pair.expected(history + follow, pair.window)
    assert chat.generate(follow, greedy(pair.window)).token_ids == expected
    assert loaded.generate(follow, greedy(pair.window)).token_ids == expected
    [plain] = engine.generate([history + follow], greedy(pair.window))
    assert plain.token_ids == expected and engine.scheduler.released_pages > 0


def test_a_global_layer_or_the_contiguous_layout_releases_nothing():
    mixed = ModelConfig.from_name("debug", model_type="mistral", sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"])
    sliding = ModelConfig.from_name("debug", model_type="mistral", sliding_window=8)
    assert Engine(Transformer(mixed), max_total_tokens=256).pool.window is None
    assert Engine(Transformer(sliding), max_total_tokens=256, contiguous=True).pool.window is None
    pool = Engine(Transformer(sliding), max_total_tokens=256, page_size=4).pool
    assert pool.window == 8 and pool.num_pages == 64 and pool.dead_page == 64  # one page more, never handed out
