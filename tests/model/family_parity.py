"""What the Phi-3 and OLMo 2 tests share: random transformers models, both load directions, greedy decoding."""

import json

import torch

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import Transformer

VOCAB = 128


def perturbed(model: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> torch.nn.Module:
    """Noise on every tensor, so norms are not all-ones and no two heads or layers are alike (`scale` 0.5: wide
    enough that greedy decoding follows the context instead of repeating one token)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def hf_random(transformers, config, scale: float = 0.1) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return perturbed(model, scale=scale)


def hf_load(transformers, path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def max_logit_gap(hf, ours, seq_len: int = 16, batch: int = 2) -> float:
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (hf(ids).logits - ours(ids).logits).abs().max().item()


def round_trip_gaps(transformers, hf_config, tmp_path, seq_len: int = 16) -> tuple[float, float, dict]:
    """(gap of transformers' save loaded here, gap of our save loaded by transformers, our config.json)."""
    hf = hf_random(transformers, hf_config)
    hf.save_pretrained(tmp_path / "hf")
    ours = Transformer.from_pretrained(tmp_path / "hf").eval()
    there = max_logit_gap(hf, ours, seq_len)
    ours.save_pretrained(tmp_path / "ours")
    back = max_logit_gap(hf_load(transformers, tmp_path / "ours"), ours, seq_len)
    return there, back, json.loads((tmp_path / "ours" / "config.json").read_text())


def edit_json(path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def greedy_pair(transformers, hf_config, tmp_path, prompts: list[list[int]], max_tokens: int, **engine_options):
    """(transformers' greedy continuation of each prompt, the engine's on the same weights loaded from its save)."""
    hf = hf_random(transformers, hf_config, scale=0.5)
    hf.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos does, with no logit masked
    hf.save_pretrained(tmp_path / "hf")
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    engine_options = {"max_total_tokens": 2048, "page_size": 4, **engine_options}
    engine = Engine(Transformer.from_pretrained(tmp_path / "hf").eval(), **engine_options)
    got = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return expected, [c.token_ids for c in got]
