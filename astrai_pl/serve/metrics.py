"""The server's Prometheus metrics, on a registry of its own (one per server, never the process-wide one).

Counters and histograms are recorded by the routes' hooks; gauges read the engine when /metrics is scraped,
so they are never stale:

    astrai_requests_total{route, status}         HTTP requests finished, by route and status code
    astrai_requests_in_flight{route}             HTTP requests being answered now (a stream until it ends)
    astrai_prompt_tokens_total                   prompt tokens of finished generation requests
    astrai_generation_tokens_total               tokens generated
    astrai_prefix_cache_hit_tokens_total         prompt tokens not computed again (prefix cache or session)
    astrai_requests_running                      engine requests being decoded now (each of n samples counts)
    astrai_requests_waiting                      engine requests queued for a batch slot or memory
    astrai_kv_pages_in_use                       KV pages held by requests and sessions
    astrai_kv_pages_free                         KV pages free
    astrai_kv_pages_evictable                    KV pages holding cached prefixes no one uses (reclaimable)
    astrai_kv_pages_capacity                     KV pages in the pool
    astrai_sessions_live                         sessions of /v1/sessions alive now
    astrai_session_kv_pages                      KV pages the sessions pin (or their running turns' prompts)
    astrai_time_to_first_token_seconds           from a request's arrival to its first generated token
    astrai_inter_token_latency_seconds           between consecutive generated tokens of one choice
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# CPU-scale buckets: a debug model answers in milliseconds, a 1B model on CPU in seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class EngineCollector(Collector):
    """Gauges read from the engine (and the session store) at scrape time."""

    def __init__(self):
        self.state = None

    def collect(self):
        if self.state is None:
            return
        engine = self.state.engine
        running, waiting = engine.load()
        usage = engine.usage()
        sessions = self.state.sessions  # live() first closes those past their TTL
        live, pinned = (0, 0) if sessions is None else (sessions.live(), sessions.pinned_pages())
        for name, value, doc in (
            ("requests_running", running, "engine requests being decoded now (each of n samples counts)"),
            ("requests_waiting", waiting, "engine requests queued for a batch slot or memory"),
            ("kv_pages_in_use", usage.in_use, "KV pages held by requests and sessions"),
            ("kv_pages_free", usage.free, "KV pages free"),
            ("kv_pages_evictable", usage.evictable, "KV pages holding cached prefixes no one uses"),
            ("kv_pages_capacity", usage.total, "KV pages in the pool"),
            ("sessions_live", live, "sessions of /v1/sessions alive now"),
            ("session_kv_pages", pinned, "KV pages the sessions pin"),
        ):
            yield GaugeMetricFamily(f"astrai_{name}", doc, value=value)


class Metrics:
    """The hooks the routes call, recorded for Prometheus; `watch(state)` adds the engine's gauges."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = EngineCollector()
        self.registry.register(self._engine)
        self._requests = Counter("astrai_requests", "HTTP requests finished, by route and status code",
                                 ["route", "status"], registry=self.registry)
        self._in_flight = Gauge("astrai_requests_in_flight", "HTTP requests being answered now", ["route"],
                                registry=self.registry)
        self._prompt = Counter("astrai_prompt_tokens", "prompt tokens of finished generation requests",
                               registry=self.registry)
        self._generated = Counter("astrai_generation_tokens", "tokens generated", registry=self.registry)
        self._cached = Counter("astrai_prefix_cache_hit_tokens", "prompt tokens not computed again (prefix "
                               "cache or session)", registry=self.registry)
        self._ttft = Histogram("astrai_time_to_first_token_seconds", "from a request's arrival to its first "
                               "token", buckets=TTFT_BUCKETS, registry=self.registry)
        self._itl = Histogram("astrai_inter_token_latency_seconds", "between consecutive tokens of one "
                              "choice", buckets=ITL_BUCKETS, registry=self.registry)

    def watch(self, state) -> None:
        """Read the gauges from `state` (a ServerState: its engine and session store) from now on."""
        self._engine.state = state

    def request_started(self, route: str) -> None:
        self._in_flight.labels(route).inc()

    def request_finished(self, route: str, status: int) -> None:
        self._in_flight.labels(route).dec()
        self._requests.labels(route, str(status)).inc()

    def tokens(self, prompt: int, generated: int, cached: int) -> None:
        self._prompt.inc(prompt)
        self._generated.inc(generated)
        self._cached.inc(cached)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
