"""QLoRA: the frozen base's linear weights in 4-bit NF4 (torchao), adapters in float32. The adapter's gradients are
those of LoRA on the dequantised base, the base takes about a quarter of its bf16 bytes, `quantize: nf4` runs from
YAML, a Hugging Face directory is read straight into NF4 one weight at a time, checkpoints hold the adapter only
and resume on the same 4-bit base, and the engine decodes over it."""

import weakref
from pathlib import Path

import pytest
import torch
from fit_runs import quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from astrai_pl.checkpoint import load_transformer
from astrai_pl.checkpoint.loading import weights_fingerprint
from astrai_pl.cli import lightning_main
from astrai_pl.data import Arithmetic, SFTData
from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import ConfigError, LoraConfig, ModelConfig, Transformer, hf, nf4
from astrai_pl.model.lora import apply_lora, dense
from astrai_pl.objectives import SFT

ROOT = Path(__file__).resolve().parents[2]
ARCH = ModelConfig.from_name("debug")  # its projections: 64·64, 32·64, 160·64 values, all in 64-value blocks
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def qlora_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return nf4.quantize_base(Transformer(ARCH))


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": m.weight for name, m in nf4.quantized_linears(model)}


def inner_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    names, _ = weight.__tensor_flatten__()
    return {n: getattr(weight, n) for n in names}


def assert_same_nf4(a: torch.nn.Module, b: torch.nn.Module) -> None:
    wa, wb = base_weights(a), base_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert nf4.is_nf4(wa[key]) and nf4.is_nf4(wb[key]), key
        for name, tensor in inner_tensors(wa[key]).items():
            assert torch.equal(tensor, getattr(wb[key], name)), (key, name)


def next_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_adapter_gradients_equal_those_of_lora_on_the_dequantised_base():
    quantized = qlora_model(seed=0)
    torch.manual_seed(0)
    dequantized = Transformer(ARCH)  # the same embeddings, norms and lm_head; its linear weights:
    for (_, module), (_, q) in zip(nf4.quantized_linears(dequantized), nf4.quantized_linears(quantized)):
        module.weight = torch.nn.Parameter(dense(q.weight), requires_grad=False)
    assert not any(nf4.is_nf4(p) for p in dequantized.parameters())
    torch.manual_seed(1)
    apply_lora(quantized, LORA)
    torch.manual_seed(1)
    apply_lora(dequantized, LORA)
    ids = torch.randint(0, ARCH.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    for model in (quantized, dequantized):
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(3))  # B ≠ 0: A gets a gradient
        next_token_loss(model, ids).backward()
    grads = {n: p.grad for n, p in dequantized.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in n for n in grads)
    for name, p in quantized.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32
            relative = (p.grad - grads[name]).norm() / grads[name].norm()
            assert relative <= 1e-5, (name, float(relative))


def test_the_base_linear_weights_take_under_three_tenths_of_their_bf16_bytes():
    model = qlora_model()
    weights = base_weights(model)
    assert all(nf4.is_nf4(w) for w in weights.values())
    stored = sum(nf4.nf4_bytes(w) for w in weights.values())
    bf16 = sum(w.numel() * 2 for w in weights.values())
    assert stored <= 0.3 * bf16, (stored, bf16)
    assert not nf4.is_nf4(model.lm_head.weight) and not nf4.is_nf4(model.embed_tokens.weight)


def test_a_weight_that_cannot_be_blocked_keeps_its_dtype_with_one_log_line(caplog):
    odd = ModelConfig.from_name("debug", hidden_size=40)  # k_proj, v_proj: 20·40 values, not whole 64-value blocks
    model = Transformer(odd)
    with caplog.at_level("WARNING", logger="astrai_pl.model.nf4"):
        nf4.quantize_base(model)
    assert len(caplog.records) == 1 and "4 linear weight(s)" in caplog.text and "k_proj.weight (20, 40)" in caplog.text
    attention = model.layers[0].self_attn
    assert not nf4.is_nf4(attention.k_proj.weight) and attention.k_proj.weight.dtype == torch.float32
    assert nf4.is_nf4(attention.q_proj.weight) and nf4.is_nf4(model.layers[1].mlp.down_proj.weight)
    assert nf4.to_nf4(torch.zeros(64, 64)) is None  # constant blocks: no finite scale, kept as is


def test_quantize_without_an_adapter_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.init_args\.quantize='nf4'.*add a model\.init_args\.lora block"):
        SFT(arch=ARCH, quantize="nf4")
    with pytest.raises(ConfigError, match=r"model\.init_args\.quantize='int4'.*only quantisation is nf4"):
        SFT(arch=ARCH, lora=LORA, quantize="int4")


def test_quantize_nf4_parses_from_yaml_and_trains_a_step(tmp_path):
    config = ROOT / "configs/sft/qlora-debug.yaml"
    cli = lightning_main(["--config", str(config), "--trainer.logger", "false", "--trainer.callbacks", "[]",
                          "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
                          "--trainer.limit_val_batches", "0", "--trainer.max_steps", "1",
                          "--trainer.default_root_dir", str(tmp_path), "--data.init_args.cache_dir", str(tmp_path)],
                         run=False)
    model = cli.model.model
    assert cli.model.hparams["quantize"] == "nf4" and model.lora_config is not None
    assert all(nf4.is_nf4(w) for w in base_weights(model).values())
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, adapter[n])]
    assert moved and all(".lora_" in n for n in moved)


class ReadRecorder:
    """Wraps hf._open: the storage of every tensor the loader reads from a file is recorded by weak reference,
    so a test can count how many full-precision linear weights are alive whenever one is quantised."""

    def __init__(self, monkeypatch):
        self.read: list[tuple[str, weakref.ref]] = []
        self.alive_at_quantisation: list[int] = []
        opener, quantize = hf._open, nf4.to_nf4

        def opened(file):
            handle = opener(file)
            get_tensor = handle.get_tensor

            class Recording:
                def __enter__(s):
                    handle.__enter__()
                    return s

                def __exit__(s, *exc):
                    return handle.__exit__(*exc)

                def __getattr__(s, name):
                    return getattr(handle, name)

                def get_tensor(s, key):
                    tensor = get_tensor(key)
                    self.read.append((key, weakref.ref(tensor.untyped_storage())))
                    return tensor

            return Recording()

        def quantized(weight):
            self.alive_at_quantisation.append(
                sum(ref() is not None for key, ref in self.read if key.endswith("_proj.weight")))
            return quantize(weight)

        monkeypatch.setattr(hf, "_open", opened)
        monkeypatch.setattr(nf4, "to_nf4", quantized)


def test_an_hf_directory_is_read_straight_into_nf4_one_full_precision_weight_at_a_time(tmp_path, monkeypatch):
    torch.manual_seed(0)
    Transformer(ARCH).save_pretrained(tmp_path / "hf")
    expected = nf4.quantize_base(Transformer.from_pretrained(tmp_path / "hf"))  # a full-precision load, then NF4
    recorder = ReadRecorder(monkeypatch)
    model = Transformer.from_pretrained(tmp_path / "hf", quantize="nf4")
    linears = len(nf4.quantized_linears(model))
    assert len(recorder.alive_at_quantisation) == linears == 7 * ARCH.num_hidden_layers
    assert max(recorder.alive_at_quantisation) == 1  # the weight being quantised, no other
    assert sum(ref() is not None for key, ref in recorder.read if key.endswith("_proj.weight")) == 0
    assert_same_nf4(model, expected)
    assert torch.equal(model.lm_head.weight, expected.lm_head.weight)
    assert all(not p.requires_grad for p in base_weights(model).values())


def fit_sft(init_from, tmp_path, steps, ckpt_path=None, quantize="nf4"):
    torch.manual_seed(0)
    data = SFTData(synthetic=Arithmetic(train_rows=48, test_rows=8), max_seq_len=64, batch_size=4,
                   cache_dir=str(tmp_path / "cache"))
    sft = SFT(arch=None if init_from else ARCH, init_from=init_from, lora=LORA, quantize=quantize,
              optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2), tokenizer=data.tokenizer)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=steps)
    trainer = quiet_trainer(max_steps=steps, limit_val_batches=0, enable_checkpointing=True, callbacks=[saver])
    trainer.fit(sft, datamodule=data, ckpt_path=ckpt_path)
    return sft, tmp_path / "ckpt" / "last.ckpt"


@pytest.mark.slow
def test_a_qlora_run_from_init_from_saves_the_adapter_only_and_resumes_on_the_same_nf4_base(tmp_path):
    torch.manual_seed(0)
    Transformer(ARCH).save_pretrained(tmp_path / "hf")
    first, ckpt = fit_sft(str(tmp_path / "hf"), tmp_path, steps=2)
    saved = torch.load(ckpt, weights_only=True)
    model_keys = [k for k in saved["state_dict"] if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert saved["lora_base"]["fingerprint"] == first.base_fingerprint
    assert saved["hyper_parameters"]["quantize"] == "nf4"
    resumed, _ = fit_sft(str(tmp_path / "hf"), tmp_path, steps=3, ckpt_path=ckpt)  # on_load_checkpoint checks it
    assert resumed.trainer.global_step == 3 and resumed.base_fingerprint == first.base_fingerprint
    assert_same_nf4(resumed.model, first.model)
    reloaded = load_transformer(None, str(ckpt)).eval()  # the base read into NF4 again, the adapter on it
    assert_same_nf4(reloaded, first.model)
    ids = torch.randint(0, ARCH.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, first.model.eval()(ids).logits, rtol=0, atol=1e-6)


def test_a_fresh_nf4_base_travels_in_the_state_dict_exactly(tmp_path):
    model = qlora_model(seed=0)
    apply_lora(model, LORA)
    state = model.state_dict()
    assert not any(nf4.is_nf4(v) for v in state.values())  # plain tensors: weights_only loads them
    torch.save(state, tmp_path / "state.pt")
    other = qlora_model(seed=1)
    apply_lora(other, LORA)
    assert weights_fingerprint(other) != weights_fingerprint(model)
    other.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert_same_nf4(other, model)
    assert weights_fingerprint(other) == weights_fingerprint(model)
    # as a run on a fresh base checkpoints it: load_transformer rebuilds the NF4 base and the adapter
    ckpt = {"state_dict": {f"model.{k}": v for k, v in state.items()},
            "hyper_parameters": {"arch": ARCH.to_dict(), "lora": LORA.to_dict(), "quantize": "nf4"}}
    torch.save(ckpt, tmp_path / "fresh.ckpt")
    reloaded = load_transformer(None, str(tmp_path / "fresh.ckpt"))
    assert_same_nf4(reloaded, model)
    assert weights_fingerprint(reloaded) == weights_fingerprint(model)


def test_the_engine_decodes_greedily_over_an_nf4_base():
    model = qlora_model()
    apply_lora(model, LORA)
    for name, p in model.named_parameters():
        if name.endswith("lora_B.weight"):
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(5))
    model.eval()
    prompt, greedy = [5, 17, 99, 3, 42], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = Engine(model, max_total_tokens=1024).generate([prompt], greedy)[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(greedy.max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.token_ids == ids[len(prompt):]
    assert all(nf4.is_nf4(w) for w in base_weights(model).values())
