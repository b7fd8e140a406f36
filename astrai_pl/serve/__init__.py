"""The HTTP server over the inference engine: OpenAI's routes, sessions, health and Prometheus metrics.

    from astrai_pl.serve.app import create_app
    from astrai_pl.serve.state import ServerState
    app = create_app(ServerState(engine, tokenizer, "my-model"))    # a FastAPI app; run it with uvicorn

`astrai-pl serve --model DIR` does the same from the command line (serve/cli.py). The package imports
nothing itself, so FastAPI loads only where the server is used.
"""
