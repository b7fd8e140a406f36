"""The engine served from many threads: one background loop steps the batch while threads submit, read,
abort and fail requests; every output equals what serial calls give, and the accounting holds throughout."""

import asyncio
import threading

import pytest

from astrai_pl.inference import RequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
POISON = [3, 1, 4, 1, 5]


class Checker:
    """Recounts the engine's accounting (under its lock) from a thread of its own until stopped."""

    def __init__(self, engine):
        self.engine, self.checks, self.error = engine, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.engine.check()
            except BaseException as err:  # reported by stop()
                self.error = err
                return
            self.checks += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error


def run_threads(target, count: int) -> list:
    """`target(i)` on `count` threads started together; their results, re-raising the first error."""
    results, errors = [None] * count, []
    barrier = threading.Barrier(count)

    def run(i):
        barrier.wait()
        try:
            results[i] = target(i)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread never finished"
    if errors:
        raise errors[0]
    return results


def test_eight_threads_submitting_at_once_get_the_serial_greedy_outputs(model, make_engine, random_prompts):
    prompts = random_prompts([5, 17, 9, 30, 12, 3, 22, 8, 14, 6, 27, 11, 4, 19, 10, 16], seed=7)
    serial = [c.token_ids for c in make_engine(model, page_size=4).generate(prompts, GREEDY)]
    engine = make_engine(model, page_size=4, max_step_tokens=48)  # debug: checked after every step too

    def client(i):
        first, second = engine.submit(prompts[2 * i], GREEDY), engine.submit(prompts[2 * i + 1], GREEDY)
        streamed = [t for delta in first for t in delta.token_ids]
        return [streamed, second.result()[0].token_ids]

    with engine, Checker(engine) as checker:
        outputs = run_threads(client, 8)
    assert [ids for pair in outputs for ids in pair] == serial
    assert checker.checks > 0
    assert engine.check().in_use == 0 and not engine.has_unfinished()


def test_generate_stream_and_sessions_are_unchanged_while_the_loop_runs(model, make_engine, random_prompts):
    prompts = random_prompts([6, 13], seed=8)
    alone = make_engine(model, page_size=4)
    expected = [c.token_ids for c in alone.generate(prompts, GREEDY)]
    chat = alone.session()
    turns = [chat.generate(prompts[0], GREEDY).token_ids, chat.generate([7, 8], GREEDY).token_ids]
    engine = make_engine(model, page_size=4)
    with engine:
        assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
        assert [t for d in engine.stream(prompts[1], GREEDY) for t in d.token_ids] == expected[1]
        chat = engine.session()
        assert [chat.generate(prompts[0], GREEDY).token_ids, chat.generate([7, 8], GREEDY).token_ids] == turns
        chat.close()
    assert engine.check().in_use == 0


def test_abort_from_another_thread_stops_the_request_and_frees_its_pages(model, make_engine, random_prompts):
    long_prompt, short_prompt = random_prompts([9, 5], seed=9)
    expected = make_engine(model).generate(short_prompt, GREEDY)[0].token_ids
    engine = make_engine(model, page_size=4)
    with engine:
        handle = engine.submit(long_prompt, SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
        other = engine.submit(short_prompt, GREEDY)
        seen, ended = threading.Event(), []

        def read():
            for _ in handle:
                seen.set()
            ended.append(True)

        reader = threading.Thread(target=read)
        reader.start()
        assert seen.wait(60), "no delta came"
        run_threads(lambda i: handle.abort(), 1)
        reader.join(60)
        assert ended == [True] and handle.done
        [aborted] = handle.result()
        assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 2000
        assert other.result()[0].token_ids == expected
    assert engine.check().in_use == 0 and not engine.has_unfinished()


def test_a_request_failing_in_the_loop_fails_alone(model, make_engine, random_prompts, monkeypatch):
    good = random_prompts([7, 20, 11], seed=10)
    expected = [c.token_ids for c in make_engine(model).generate(good, GREEDY)]
    engine = make_engine(model, page_size=4)
    forward = engine.runner.forward

    def failing_forward(plan):
        if any(req.tokens[: len(POISON)] == POISON for req, _ in plan):
            raise RuntimeError("injected forward failure")
        return forward(plan)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    with engine:
        handles = [engine.submit(p, GREEDY) for p in (good[0], POISON + [9, 10], good[1], good[2])]
        with pytest.raises(RequestError, match="injected forward failure"):
            list(handles[1])
        assert [h.result()[0].token_ids for h in handles[::2] + handles[3:]] == expected
    assert engine.check().in_use == 0


def test_handles_are_awaited_from_asyncio_with_or_without_the_loop(model, make_engine, random_prompts):
    prompts = random_prompts([8, 15], seed=11)
    expected = [c.token_ids for c in make_engine(model).generate(prompts, GREEDY)]
    engine = make_engine(model, page_size=4)

    async def client():
        first, second = engine.submit(prompts[0], GREEDY), engine.submit(prompts[1], GREEDY)
        streamed = [t async for delta in first for t in delta.token_ids]
        return [streamed, (await second.result_async())[0].token_ids]

    assert asyncio.run(client()) == expected  # each await steps the engine off the event loop
    with engine:
        assert asyncio.run(client()) == expected
    assert engine.check().in_use == 0
