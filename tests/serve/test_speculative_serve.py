"""`astrai-pl serve --speculative-config JSON`: vLLM's flag parsed and checked, and the served greedy completions
(plain and streamed, through the openai client) equal those of the engine without speculation."""

import openai
import pytest
import test_commands
from served import TIMEOUT, running

from astrai_pl.commands import load_engine
from astrai_pl.inference import SamplingParams
from astrai_pl.serve.cli import serve_parser
from astrai_pl.serve.state import ServerState

tokenizer, model_dir, engine = test_commands.tokenizer, test_commands.model_dir, test_commands.engine
FLAG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


def test_the_flag_is_parsed_and_checked(capsys):
    ns = serve_parser().parse_args(["--model", "m", "--speculative-config", FLAG])
    assert (ns.speculative_config.num_speculative_tokens, ns.speculative_config.prompt_lookup_max) == (4, 3)
    assert serve_parser().parse_args(["--model", "m"]).speculative_config is None  # off by default
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "m", "--speculative-config", '{"method": "medusa"}'])
    assert "ngram" in capsys.readouterr().err


def test_served_completions_equal_the_plain_engine(model_dir, engine, tokenizer):
    ns = serve_parser().parse_args(["--model", str(model_dir), "--max-total-tokens", "4096",
                                    "--speculative-config", FLAG])
    speculative, tok, eos_ids = load_engine(ns)
    assert speculative.speculative is not None
    prompt = "abcabcabc abcabc abc"
    [want] = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0))
    state = ServerState(speculative, tok, "spec", stop_token_ids=eos_ids)
    with running(state) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=TIMEOUT,
                                              max_retries=0) as client:
        got = client.completions.create(model="spec", prompt=prompt, max_tokens=24, temperature=0)
        streamed = client.completions.create(model="spec", prompt=prompt, max_tokens=24, temperature=0,
                                             stream=True)
        text = "".join(chunk.choices[0].text for chunk in streamed)
    assert got.choices[0].text == text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert speculative.stats.draft_tokens > 0
