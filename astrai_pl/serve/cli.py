"""`astrai-pl serve`: the OpenAI-compatible HTTP server on a model directory or checkpoint.

    astrai-pl serve --model hf_dir/ --port 8000
    astrai-pl serve --model base_hf_dir/ --adapter lora_adapter/ --api-key "$KEY" --max-queue 64
    astrai-pl serve --model hf_dir/ --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    astrai-pl serve --model base_hf_dir/ --lora-modules sql=adapters/sql chat=adapters/chat

SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish for --graceful-timeout
seconds, aborts the rest, stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ..commands import USER_ERRORS, _add_model_arguments, load_engine
from ..inference import EngineConfigError, InferenceError, SpeculativeConfig
from ..inference.adapters import load_lora_adapter
from .app import create_app
from .connections import ConnectionLimits, server_config
from .lora_models import parse_lora_module
from .sessions_api import DEFAULT_MAX_SESSIONS, DEFAULT_MAX_TTL_S, DEFAULT_TTL_S, SessionStore
from .state import ServerState, check_api_keys


def _at_least(low: int | float, kind=int):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low}")
        return value

    return parse


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="astrai-pl serve",
        description="Serve a model over HTTP: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, "
                    "plus /health and /metrics.")
    _add_model_arguments(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=_at_least(0), default=8000)
    group.add_argument("--api-key", action="append", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes; repeat it for several clients' keys "
                            "(default: $ASTRAI_API_KEY); an empty key is refused")
    group.add_argument("--cache-salt-per-key", action="store_true",
                       help="each API key's requests share cached prompt prefixes only with that key's: no client "
                            "learns from cache hits what another sent")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens (off by default: cache hits tell a "
                            "client which prefixes other requests of its cache salt sent)")
    group.add_argument("--max-connections", type=_at_least(1), default=ConnectionLimits.max_connections,
                       help="connections open at once; more are closed as they open")
    group.add_argument("--header-timeout", type=_positive, default=ConnectionLimits.header_timeout,
                       help="seconds a client has to send a request's headers before its connection is closed")
    group.add_argument("--keep-alive-timeout", type=_at_least(1), default=ConnectionLimits.keep_alive_timeout,
                       help="seconds an idle connection stays open between requests")
    group.add_argument("--max-queue", type=_at_least(1), default=None,
                       help="most generation requests in flight at once; more get HTTP 429 (default: no limit)")
    group.add_argument("--max-model-len", type=_at_least(2), default=None,
                       help="longest prompt + completion served, in tokens (default: the engine's context)")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients pass as 'model' (default: the --model path's name)")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                       help="LoRA adapters (PEFT directories) served beside the base, each chosen by a request's "
                            "'model': NAME; also vLLM's JSON form '{\"name\": NAME, \"path\": DIR}'")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run every decode step eagerly, without CUDA graphs (on by default on a GPU)")
    group.add_argument("--speculative-config", type=_speculative, default=None, metavar="JSON",
                       help='n-gram speculative decoding, as vLLM\'s flag: \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (off by default: it costs '
                            'when outputs do not quote their prompts; docs/benchmarks.md)')
    group.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                       help="how tool calls are read out of replies (default: from the chat template)")
    group.add_argument("--graceful-timeout", type=_at_least(0, float), default=30.0,
                       help="seconds requests in flight may take to finish on shutdown before they are aborted")
    sessions = parser.add_argument_group("sessions (/v1/sessions)")
    sessions.add_argument("--max-sessions", type=_at_least(1), default=DEFAULT_MAX_SESSIONS,
                          help="most live sessions at once; more get HTTP 429")
    sessions.add_argument("--session-ttl", type=_positive, default=DEFAULT_TTL_S,
                          help="seconds a session lives idle when its request names no 'ttl'")
    sessions.add_argument("--max-session-ttl", type=_positive, default=DEFAULT_MAX_TTL_S,
                          help="the longest 'ttl' a request may ask for, in seconds")
    sessions.add_argument("--max-session-tokens", type=_at_least(1), default=None,
                          help="KV tokens all sessions may pin together (default: half the pool)")
    return parser


def _speculative(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except EngineConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def load_lora_modules(engine, base_name: str, specs: list[str]) -> None:
    """Load each `--lora-modules` value (name=DIR or JSON) as an adapter of `engine`."""
    for spec in specs:
        lora_name, path = parse_lora_module(spec)
        if lora_name == base_name:
            raise ValueError(f"--lora-modules {spec!r}: '{lora_name}' is the base model's id; pick another name")
        load_lora_adapter(engine, lora_name, path)


def _positive(text: str) -> float:
    value = _at_least(0, float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError("0 is not positive")
    return value


def _env_key() -> list[str] | None:
    """$ASTRAI_API_KEY as the server's key; set and empty is an empty key, which is refused."""
    key = os.environ.get("ASTRAI_API_KEY")
    return None if key is None else [key]


def _ignore(signum, frame) -> None:
    """uvicorn raises the signal it shut down on once more; with this handler that ends nothing."""


def startup_line(engine, state, host: str, port: int) -> str:
    """What is being served, where and in how much memory: one line before uvicorn's own."""
    usage = engine.usage()
    if hasattr(usage, "slots_total"):  # a recurrent model: a state slot per running request, not K/V pages
        memory = f"{usage.slots_total} state slots of {usage.state_bytes / 2**20:.1f} MiB"
    else:
        memory = f"KV capacity {usage.total * usage.page_size:,} tokens ({usage.total:,} pages of {usage.page_size})"
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return (f"astrai-pl serve: model {state.model_name!r} on {engine.device} ({str(engine.dtype).removeprefix('torch.')}), "
            f"context {state.context_len:,} tokens, {memory}; OpenAI API at http://{shown}:{port}/v1")


def serve_verb(argv: list[str]) -> None:
    """`astrai-pl serve`: build the engine, serve it until SIGTERM or Ctrl-C."""
    import uvicorn

    ns = serve_parser().parse_args(argv)
    keys = ns.api_key if ns.api_key is not None else _env_key()
    try:
        check_api_keys(keys)  # before the model is loaded: an unset $KEY must not serve without one
        limits = ConnectionLimits(ns.max_connections, ns.header_timeout, ns.keep_alive_timeout)
        if ns.cache_salt_per_key and not keys:
            raise ValueError("--cache-salt-per-key needs --api-key: the keys tell clients apart")
    except ValueError as err:
        raise SystemExit(f"astrai-pl serve: {err}") from None
    try:
        engine, tokenizer, eos_ids = load_engine(ns)
    except USER_ERRORS as err:
        raise SystemExit(f"astrai-pl serve: {err}") from None
    name = ns.served_model_name or Path(ns.model).resolve().name
    try:
        load_lora_modules(engine, name, ns.lora_modules)
    except (ValueError, OSError, InferenceError) as err:  # CheckpointError and ConfigError are ValueErrors
        raise SystemExit(f"astrai-pl serve: {err}") from None
    try:
        sessions = SessionStore(engine, ttl=ns.session_ttl, max_ttl=ns.max_session_ttl,
                                max_sessions=ns.max_sessions, max_tokens=ns.max_session_tokens)
    except ValueError as err:
        raise SystemExit(f"astrai-pl serve: {err}") from None
    state = ServerState(engine, tokenizer, name, api_key=keys, salt_per_key=ns.cache_salt_per_key,
                        report_cached_tokens=ns.enable_prompt_tokens_details, max_queue=ns.max_queue,
                        max_model_len=ns.max_model_len, stop_token_ids=eos_ids, sessions=sessions,
                        tool_call_parser=ns.tool_call_parser)
    config = server_config(create_app(state), ns.host, ns.port, limits, lifespan="on",
                           timeout_graceful_shutdown=ns.graceful_timeout, log_level="info")
    server = uvicorn.Server(config)
    print(startup_line(engine, state, ns.host, ns.port), file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _ignore)
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C, or the one uvicorn raises again after shutting down
        pass
    finally:
        state.abort_all()
        engine.stop()
    if not server.started:
        raise SystemExit(f"astrai-pl serve: could not listen on {ns.host}:{ns.port} (see the log above)")
