"""The command line with LoRA adapters: `convert` writes a LoRA run's adapter as a PEFT directory or, with
--merge-lora, the merged model that PEFT's merge_and_unload gives; `generate` and `chat` serve a base with an
adapter directory (ours or PEFT's own) or a LoRA run's checkpoint, with the adapted model's tokens."""

import io
import json

import pytest
import torch
from test_commands import wide_model

from astrai_pl.cli import main
from astrai_pl.commands import chat_verb, generate_verb
from astrai_pl.model import Transformer
from astrai_pl.model.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from astrai_pl.objectives import SFT
from astrai_pl.tokenizer import Tokenizer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
PROMPT = "Once upon a time"
GREEDY = ["--temperature", "0", "--max-tokens", "8"]


def noisy_b(model, seed: int = 0) -> None:
    """B at noise: a fresh adapter (B zero) computes the base and would prove nothing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    wide_model().save_pretrained(path, tokenizer=Tokenizer.byte_level())
    return path


@pytest.fixture(scope="module")
def lora_run(base_dir, tmp_path_factory):
    """A LoRA SFT run's checkpoint from base_dir (adapter only, base recorded), and its adapted model."""
    module = SFT(init_from=str(base_dir), lora=LORA)
    noisy_b(module.model)
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    assert "lora_base" in checkpoint
    ckpt = tmp_path_factory.mktemp("run") / "last.ckpt"
    torch.save(checkpoint, ckpt)
    return ckpt, module.model.eval()


@pytest.fixture(scope="module")
def peft_adapter(base_dir, tmp_path_factory):
    """An adapter written by PEFT itself (on q_proj and v_proj), with non-zero B."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    path = tmp_path_factory.mktemp("peft_adapter")
    peft.get_peft_model(hf, config).save_pretrained(path)
    return path


def peft_on(base_dir, adapter_dir):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))


def assert_same_logits(a, b, atol=1e-4):
    with torch.no_grad():
        torch.testing.assert_close(a(ids()).logits, b(ids()).logits, atol=atol, rtol=0)


def assert_state_dicts_equal(ours: dict, theirs: dict, atol=1e-5):
    assert ours.keys() == theirs.keys()
    worst = max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in ours)
    assert worst <= atol, worst


# -- convert -----------------------------------------------------------------------------------------------
def test_convert_writes_a_lora_run_as_a_peft_adapter_with_the_runs_logits(base_dir, lora_run, tmp_path, capsys):
    ckpt, adapted = lora_run
    main(["convert", "--ckpt", str(ckpt), "--output", str(tmp_path / "adapter"), "--tokenizer", "byte"])
    assert "PEFT adapter directory" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json"}
    assert not (tmp_path / "adapter" / "config.json").exists()  # the adapter only, not the base
    assert_same_logits(peft_on(base_dir, tmp_path / "adapter"), adapted)


def test_convert_merge_lora_writes_what_peft_merge_and_unload_gives(base_dir, lora_run, tmp_path, capsys):
    ckpt, adapted = lora_run
    main(["convert", "--ckpt", str(ckpt), "--output", str(tmp_path / "adapter")])
    main(["convert", "--ckpt", str(ckpt), "--merge-lora", "--output", str(tmp_path / "merged")])
    assert "Hugging Face model directory" in capsys.readouterr().out
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    reference = peft_on(base_dir, tmp_path / "adapter").merge_and_unload()
    assert_state_dicts_equal(merged.state_dict(), reference.state_dict())
    assert_same_logits(merged, adapted)
    assert not (tmp_path / "merged" / ADAPTER_CONFIG).exists()


def test_convert_puts_a_peft_written_adapter_on_a_hugging_face_base(base_dir, peft_adapter, tmp_path):
    main(["convert", "--ckpt", str(base_dir), "--adapter", str(peft_adapter), "--merge-lora",
          "--output", str(tmp_path / "merged")])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    reference = peft_on(base_dir, peft_adapter).merge_and_unload()
    assert_state_dicts_equal(merged.state_dict(), reference.state_dict())

    main(["convert", "--ckpt", str(base_dir), "--adapter", str(peft_adapter), "--output", str(tmp_path / "again")])
    assert_same_logits(peft_on(base_dir, tmp_path / "again"), peft_on(base_dir, peft_adapter))
    config = json.loads((tmp_path / "again" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"]  # PEFT's own record of its base, or the base it was put on


def test_convert_refuses_mismatched_adapter_options_naming_the_fix(base_dir, lora_run, peft_adapter, tmp_path):
    ckpt, _ = lora_run
    with pytest.raises(SystemExit, match=r"--merge-lora: .* holds no LoRA adapter; pass one with --adapter"):
        main(["convert", "--ckpt", str(base_dir), "--merge-lora", "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"already holds a LoRA adapter .*leave --adapter out"):
        main(["convert", "--ckpt", str(ckpt), "--adapter", str(peft_adapter), "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"is a PEFT adapter directory, not a model; pass its base model as --ckpt"):
        main(["convert", "--ckpt", str(peft_adapter), "--output", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# -- generate and chat -------------------------------------------------------------------------------------
@torch.no_grad()
def forward_greedy(model, prompt: list[int], max_tokens: int = 8) -> list[int]:
    """Greedy decoding by a full forward over the whole sequence at every step, up to an end token."""
    seq, ends = list(prompt), Tokenizer.byte_level().eos_token_ids
    for _ in range(max_tokens):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        if seq[-1] in ends:
            break
    return seq[len(prompt):]


def generated_ids(tmp_path, *args) -> list[int]:
    out = tmp_path / "out.jsonl"
    generate_verb(["--prompt", PROMPT, "--no-chat-template", *GREEDY, "--output", str(out), *args])
    return json.loads(out.read_text())["token_ids"]


def test_generate_with_a_peft_adapter_gives_the_adapted_models_tokens(base_dir, peft_adapter, tmp_path):
    prompt = Tokenizer.byte_level().encode(PROMPT)
    tokens = generated_ids(tmp_path, "--model", str(base_dir), "--adapter", str(peft_adapter))
    assert tokens == forward_greedy(peft_on(base_dir, peft_adapter), prompt)
    assert tokens != forward_greedy(Transformer.from_pretrained(base_dir).eval(), prompt)  # the adapter shows


def test_generate_on_a_lora_runs_checkpoint_gives_the_runs_tokens(lora_run, tmp_path):
    ckpt, adapted = lora_run
    prompt = Tokenizer.byte_level().encode(PROMPT)
    assert generated_ids(tmp_path, "--model", str(ckpt)) == forward_greedy(adapted, prompt)


def test_generate_refuses_an_adapter_given_as_the_model(peft_adapter):
    with pytest.raises(SystemExit, match=r"astrai-pl generate: --model .* is a PEFT adapter directory"):
        generate_verb(["--model", str(peft_adapter), "--prompt", PROMPT])


def test_chat_with_an_adapter_answers_as_the_adapted_model(base_dir, lora_run, tmp_path):
    _, adapted = lora_run
    main(["convert", "--ckpt", str(lora_run[0]), "--output", str(tmp_path / "adapter")])
    stdout = io.StringIO()
    chat_verb(["--model", str(base_dir), "--adapter", str(tmp_path / "adapter"), *GREEDY],
              stdin=io.StringIO("Hello there\n/exit\n"), stdout=stdout)
    tokenizer = Tokenizer.byte_level()
    prompt = [tokenizer.bos_token_id,
              *tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)]
    expected = [t for t in forward_greedy(adapted, prompt) if t not in tokenizer.eos_token_ids]
    assert stdout.getvalue() == tokenizer.decode(expected) + "\n"
