"""`astrai-pl serve` says at start what it serves, on what, in how much memory and where."""

from served import MODEL

from astrai_pl.serve.cli import startup_line


def test_the_startup_line_names_model_device_dtype_context_capacity_and_url(state, engine):
    line = startup_line(engine, state, "0.0.0.0", 8123)
    usage = engine.usage()
    assert f"model {MODEL!r} on cpu (float32)" in line
    assert f"context {state.context_len:,} tokens" in line
    assert f"KV capacity {usage.total * usage.page_size:,} tokens" in line
    assert line.endswith("OpenAI API at http://127.0.0.1:8123/v1")
