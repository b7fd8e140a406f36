"""The official openai client against the server: answers equal the engine's own on the same prompts."""

import asyncio

import openai
import pytest
from served import MODEL, TIMEOUT, running

from astrai_pl.commands import chat_ids
from astrai_pl.inference import SamplingParams
from astrai_pl.serve.state import ServerState

PROMPTS = ["Once upon a time", "The capital of France is"]
USER = [{"role": "user", "content": "What is 2 + 3?"}]


def offline(engine, prompts, **params):
    return engine.generate(prompts, SamplingParams(**params))


def test_greedy_completions_equal_the_engines_for_text_and_token_id_prompts(client, engine, tokenizer):
    reference = offline(engine, PROMPTS, max_tokens=8, temperature=0)
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in out.choices] == [r.text for r in reference]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.finish_reason for c in out.choices] == [r.finish_reason for r in reference]
    ids = [tokenizer.encode(p) for p in PROMPTS]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [r.text for r in reference]
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=8, temperature=0)
    assert single.choices[0].text == reference[1].text
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")


def test_usage_counts_prompt_and_generated_tokens(client, engine, tokenizer):
    reference = offline(engine, PROMPTS, max_tokens=6, temperature=0, n=2)
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in PROMPTS)  # each prompt once, whatever n
    generated = sum(len(r.token_ids) for r in reference)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, generated)
    assert out.usage.total_tokens == prompt_tokens + generated


def test_a_repeated_prompt_reports_cached_tokens(client):
    prompt = "A prompt long enough to fill whole pages of the prefix cache, twice over."
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_greedy_chat_equals_the_engine_on_the_chat_template(client, engine, tokenizer):
    [reference] = offline(engine, [chat_ids(tokenizer, USER)], max_tokens=8, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == reference.text
    assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(chat_ids(tokenizer, USER))
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]}]
    by_parts = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=8, temperature=0)
    assert by_parts.choices[0].message.content == reference.text


def test_streamed_completion_concatenates_to_the_engines_text(client, engine):
    [reference] = offline(engine, PROMPTS[:1], max_tokens=10, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_async_streamed_chat_opens_with_the_role_and_equals_the_engine(async_client, engine, tokenizer):
    [reference] = offline(engine, [chat_ids(tokenizer, USER)], max_tokens=8, temperature=0)

    async def chat():
        stream = await async_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8,
                                                            temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
        await async_client.close()
        return chunks

    chunks = asyncio.run(asyncio.wait_for(chat(), 60))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason


def test_async_requests_at_once_each_get_their_own_answer(async_client, engine):
    reference = offline(engine, PROMPTS, max_tokens=8, temperature=0)

    async def both():
        answers = await asyncio.gather(*[async_client.completions.create(
            model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in PROMPTS])
        await async_client.close()
        return answers

    answers = asyncio.run(asyncio.wait_for(both(), 60))
    assert [a.choices[0].text for a in answers] == [r.text for r in reference]


def test_n_samples_with_a_seed_repeat_and_equal_the_engines(client, engine):
    reference = offline(engine, PROMPTS[:1], max_tokens=8, temperature=1.0, seed=7, n=3)
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7, n=3)
            for _ in range(2)]
    for out in runs:
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.text for c in out.choices] == [r.text for r in reference]
    assert len({r.text for r in reference}) > 1  # sample i draws from seed + i
    other = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=8, n=3)
    assert [c.text for c in other.choices] != [c.text for c in runs[0].choices]


def test_streamed_n_samples_arrive_under_their_indices(client, engine):
    reference = offline(engine, PROMPTS[:1], max_tokens=6, temperature=1.0, seed=3, n=2)
    texts = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=3,
                                           n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [r.text for r in reference]


def test_a_stop_string_cuts_the_text_before_it(client, engine):
    [full] = offline(engine, PROMPTS[:1], max_tokens=12, temperature=0)
    stop = full.text[5:7]
    [reference] = offline(engine, PROMPTS[:1], max_tokens=12, temperature=0, stop=[stop])
    assert reference.text == full.text[: full.text.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (reference.text, "stop")
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0, stop=[stop])
    assert stop not in chat.choices[0].message.content


def test_completion_logprobs_are_the_engines_with_top_alternatives(client, engine):
    [reference] = offline(engine, PROMPTS[:1], max_tokens=5, temperature=0, top_logprobs=3)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(reference.logprobs)
    assert "".join(logprobs.tokens) == reference.text
    assert [len(top) for top in logprobs.top_logprobs] == [3] * 5
    for top, alternatives in zip(logprobs.top_logprobs, reference.top_logprobs):
        assert list(top.values()) == pytest.approx([lp for _, lp in alternatives])
    assert logprobs.text_offset == list(range(5))  # one printable character per token


def test_echo_returns_the_prompt_and_its_logprobs(client, engine, tokenizer):
    prompt = PROMPTS[0]
    [reference] = offline(engine, [prompt], max_tokens=3, temperature=0, logprobs=True, prompt_logprobs=0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0)
    choice = out.choices[0]
    assert choice.text == prompt + reference.text
    ids = tokenizer.encode(prompt)
    assert choice.logprobs.token_logprobs[0] is None
    expected = [lp for lp, _ in reference.prompt_logprobs[1:]] + reference.logprobs
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected)
    assert len(choice.logprobs.tokens) == len(ids) + 3


def test_chat_logprobs_and_top_logprobs(client, engine, tokenizer):
    [reference] = offline(engine, [chat_ids(tokenizer, USER)], max_tokens=4, temperature=0, top_logprobs=2)
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx(reference.logprobs)
    assert "".join(t.token for t in content) == reference.text
    for token, alternatives in zip(content, reference.top_logprobs, strict=True):
        assert [a.logprob for a in token.top_logprobs] == pytest.approx([lp for _, lp in alternatives])
    streamed = [t.logprob for chunk in client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, temperature=0, logprobs=True, stream=True)
        for choice in chunk.choices if choice.logprobs for t in choice.logprobs.content]
    assert streamed == pytest.approx(reference.logprobs)


def test_models_lists_the_served_model(client, state):
    [model] = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert model.model_extra["max_model_len"] == state.context_len
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")


def test_fields_openai_has_and_the_server_needs_not_are_ignored(client, engine, tokenizer):
    [reference] = offline(engine, [chat_ids(tokenizer, USER)], max_tokens=4, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0, user="u-1",
                                         response_format={"type": "text"}, store=False, tool_choice="none",
                                         extra_body={"some_future_field": {"x": 1}})
    assert out.choices[0].message.content == reference.text


def test_the_models_extra_end_ids_end_a_completion(engine, tokenizer):
    [full] = offline(engine, PROMPTS[:1], max_tokens=8, temperature=0)
    end = full.token_ids[3]
    state = ServerState(engine, tokenizer, MODEL, stop_token_ids=[end])
    with running(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        ignoring = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    first = full.token_ids.index(end)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == first + 1
    assert ignoring.choices[0].text == full.text  # ignore_eos passes them too, as the engine's own end ids


def test_concurrent_streams_share_the_engines_steps(async_client, engine):
    """Two streams at once are decoded in the same batch: far fewer steps than one after the other."""
    length = 40

    async def stream(prompt):
        chunks = await async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=length, stream=True,
                                                       temperature=0, extra_body={"ignore_eos": True})
        return [chunk async for chunk in chunks]

    async def both():
        answers = await asyncio.gather(*[stream(p) for p in PROMPTS])
        await async_client.close()
        return answers

    before = engine.stats.steps
    answers = asyncio.run(asyncio.wait_for(both(), 60))
    assert [len(a) for a in answers] == [length, length]
    assert engine.stats.steps - before < 2 * length - length // 2


def test_max_tokens_0_with_echo_scores_the_prompt_alone(client, engine):
    """The log-likelihood request of evaluation harnesses: prefill only, the prompt's logprobs echoed."""
    prompt = PROMPTS[1]
    [reference] = offline(engine, [prompt], max_tokens=0, logprobs=True, prompt_logprobs=0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason, out.usage.completion_tokens) == (prompt, "length", 0)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([lp for lp, _ in reference.prompt_logprobs[1:]])
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, stream=True))
    assert [c.choices[0].finish_reason for c in chunks] == ["length"]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_a_streamed_echo_opens_with_the_prompt_and_its_logprobs(client, engine, max_tokens):
    """Each choice's first chunk is its prompt with the prompt tokens' logprobs (first one null), as in the
    unstreamed answer; the generated tokens' chunks follow."""
    prompt = PROMPTS[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      echo=True, logprobs=1)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    opening = chunks[0].choices[0]
    assert opening.text == prompt and opening.logprobs.token_logprobs[0] is None
    n_prompt = len(opening.logprobs.tokens)
    assert opening.logprobs.token_logprobs == pytest.approx(whole.choices[0].logprobs.token_logprobs[:n_prompt])
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs)
