"""/metrics: Prometheus' text format, counters that move with the requests served, gauges read from the
engine when scraped, one registry per server."""

from prometheus_client.parser import text_string_to_metric_families

from astrai_pl.commands import chat_ids
from astrai_pl.serve.metrics import Metrics

USER = [{"role": "user", "content": "Hi!"}]


def scrape(http) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("astrai_"), family.name
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples


def requests_of(samples, route, status) -> float:
    return samples.get(("astrai_requests_total", (("route", route), ("status", str(status)))), 0.0)


def test_counters_move_with_what_the_requests_did(http, tokenizer):
    before = scrape(http)
    body = {"prompt": "A prompt that fills a few whole pages of the prefix cache.", "max_tokens": 6,
            "temperature": 0}
    first = http.post("/v1/completions", json=body).json()["usage"]
    second = http.post("/v1/completions", json=body).json()["usage"]
    chat = {"messages": USER, "max_tokens": 4, "temperature": 0, "stream": True}
    http.post("/v1/chat/completions", json=chat)
    http.get("/v1/nowhere")
    after = scrape(http)

    def moved(name):
        return after[name, ()] - before.get((name, ()), 0.0)

    def served(route, status):
        return requests_of(after, route, status) - requests_of(before, route, status)

    assert served("/v1/completions", 200) == 2 and served("/v1/chat/completions", 200) == 1
    assert served("other", 404) == 1
    generated = first["completion_tokens"] + second["completion_tokens"] + chat["max_tokens"]
    assert moved("astrai_generation_tokens_total") == generated
    assert moved("astrai_prompt_tokens_total") == first["prompt_tokens"] + second["prompt_tokens"] + len(
        chat_ids(tokenizer, USER))
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in (first, second))
    assert moved("astrai_prefix_cache_hit_tokens_total") >= cached > 0
    assert moved("astrai_time_to_first_token_seconds_count") == 3  # one per request
    assert moved("astrai_inter_token_latency_seconds_count") == 5 + 5 + 3  # between tokens of each choice


def test_gauges_read_the_engine_when_scraped(http, engine):
    samples = scrape(http)
    usage = engine.usage()
    pages = {k: samples[f"astrai_kv_pages_{k}", ()] for k in ("free", "evictable", "in_use", "capacity")}
    assert pages == {"free": usage.free, "evictable": usage.evictable, "in_use": usage.in_use,
                     "capacity": usage.total}
    assert (samples["astrai_requests_running", ()], samples["astrai_requests_waiting", ()]) == engine.load()
    live = samples["astrai_sessions_live", ()]
    session = http.post("/v1/sessions", json={"messages": USER}).json()
    held = scrape(http)
    assert held["astrai_sessions_live", ()] == live + 1
    assert held["astrai_session_kv_pages", ()] >= session["pages"] > 0
    assert held["astrai_kv_pages_in_use", ()] == engine.usage().in_use > 0
    http.delete(f"/v1/sessions/{session['id']}")
    freed = scrape(http)  # no request ran since: the gauges are read now, not when something was served
    assert freed["astrai_sessions_live", ()] == live
    assert freed["astrai_session_kv_pages", ()] < held["astrai_session_kv_pages", ()]
    assert freed["astrai_kv_pages_in_use", ()] == engine.usage().in_use < held["astrai_kv_pages_in_use", ()]


def test_each_server_counts_on_its_own_registry():
    one, two = Metrics(), Metrics()  # the process-wide registry would refuse the second's names
    one.request_started("/v1/models")
    one.request_finished("/v1/models", 200)
    one.tokens(prompt=5, generated=3, cached=2)
    families = text_string_to_metric_families(two.render().decode())
    counts = {s.name: s.value for f in families for s in f.samples}
    assert counts["astrai_prompt_tokens_total"] == 0 and "astrai_requests_total" not in counts
    text = one.render().decode()
    assert 'astrai_requests_total{route="/v1/models",status="200"} 1.0' in text
    assert "astrai_prompt_tokens_total 5.0" in text and "astrai_prefix_cache_hit_tokens_total 2.0" in text
