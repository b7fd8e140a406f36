"""Trainable tokens beside a LoRA adapter (PEFT's trainable_token_indices): what trains, what it computes, and
PEFT's format both ways."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_hf import our_model

from astrai_pl.model import ConfigError, LoraConfig, Transformer, adapters_disabled, merge_lora
from astrai_pl.model.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from astrai_pl.model.lora import adapter_state, apply_lora, base_of
from astrai_pl.model.trainable_tokens import TokenEmbedding, TokenHead
from astrai_pl.tokenizer import Tokenizer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TOKENS = [3, 4]


def tokened(tie: bool = True, base_dir=None, **lora) -> Transformer:
    """A llama-shaped model with q_proj/v_proj adapters and trainable rows for TOKENS, the rows moved off the
    base's (fresh rows equal the base's and would prove nothing)."""
    model = our_model("llama", tie_word_embeddings=tie)
    if base_dir is not None:
        model.save_pretrained(base_dir)
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, trainable_token_indices=TOKENS, **lora))
    with torch.no_grad():
        model.embed_tokens.token_rows.add_(torch.randn(model.embed_tokens.token_rows.shape,
                                                       generator=torch.Generator().manual_seed(0)))
    return model.eval()


def ids(model: Transformer) -> torch.Tensor:
    x = torch.randint(5, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    x[:, 2], x[:, 7] = 3, 4  # the trained tokens as inputs too
    return x


def test_only_the_named_rows_train_and_a_tied_head_predicts_with_them():
    model = our_model("llama", tie_word_embeddings=True)
    x = ids(model)
    before = model(x).logits
    apply_lora(model, LoraConfig(r=4, trainable_token_indices=TOKENS))
    assert isinstance(model.embed_tokens, TokenEmbedding) and isinstance(model.lm_head, TokenHead)
    assert torch.equal(model(x).logits, before)  # fresh rows are the base's
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.token_rows" in trainable and "embed_tokens.weight" not in trainable
    model(x).logits[..., 4].sum().backward()
    grad = model.embed_tokens.token_rows.grad
    assert grad is not None and grad[1].abs().sum() > 0  # row 1 is token 4: the head's logit reaches it
    assert model.embed_tokens.weight.grad is None
    with torch.no_grad():
        model.embed_tokens.token_rows.mul_(3.0)
    after = model(x).logits
    assert not torch.allclose(after[..., 4], before[..., 4])
    untouched = model(torch.full((1, 4), 9)).logits[..., 5:]  # no trained token in or out: unchanged
    with adapters_disabled(model):
        torch.testing.assert_close(model(x).logits, before)
        torch.testing.assert_close(model(torch.full((1, 4), 9)).logits[..., 5:], untouched)


def test_token_strings_resolve_with_the_tokenizer_and_unknown_ones_are_refused():
    tokenizer = Tokenizer.byte_level()
    model = our_model("llama")
    apply_lora(model, LoraConfig(r=4, trainable_token_indices=["<|im_start|>", "<|im_end|>"]), tokenizer)
    assert model.lora_config.trainable_token_indices == [tokenizer.token_to_id("<|im_start|>"),
                                                         tokenizer.token_to_id("<|im_end|>")]
    with pytest.raises(ConfigError, match="no such token"):
        apply_lora(our_model("llama"), LoraConfig(r=4, trainable_token_indices=["<|nope|>"]), tokenizer)
    with pytest.raises(ConfigError, match="no tokenizer"):
        apply_lora(our_model("llama"), LoraConfig(r=4, trainable_token_indices=["<|im_end|>"]))
    with pytest.raises(ConfigError, match="past the embedding"):
        apply_lora(our_model("llama"), LoraConfig(r=4, trainable_token_indices=[10_000]))
    for bad in ([], [-1], {"lm_head": [3]}, [True]):
        with pytest.raises(ConfigError, match="trainable_token_indices"):
            LoraConfig(trainable_token_indices=bad)
    with pytest.raises(ConfigError, match="modules_to_save"):
        apply_lora(our_model("llama", tie_word_embeddings=False),
                   LoraConfig(r=4, modules_to_save=["embed_tokens"], trainable_token_indices=TOKENS))


@pytest.mark.parametrize("tie", [True, False])
def test_merge_writes_the_rows_and_base_of_restores_the_base(tie):
    model = tokened(tie)
    x = ids(model)
    adapted = model(x).logits
    with adapters_disabled(model):
        base_logits = model(x).logits
    torch.testing.assert_close(base_of(model).eval()(x).logits, base_logits)
    merged = merge_lora(model)
    assert type(merged.embed_tokens) is torch.nn.Embedding and not isinstance(merged.lm_head, TokenHead)
    assert (merged.lm_head.weight is merged.embed_tokens.weight) == tie
    torch.testing.assert_close(merged(x).logits, adapted, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_our_trainable_tokens_load_in_peft_with_our_logits(tmp_path, tie):
    model = tokened(tie, base_dir=tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    rows = tensors["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    torch.testing.assert_close(rows, model.embed_tokens.token_rows.detach())
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["trainable_token_indices"] == TOKENS
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = ids(model)
    torch.testing.assert_close(model(x).logits, theirs(x).logits, atol=1e-4, rtol=0)
    back = Transformer.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter").eval()
    torch.testing.assert_close(back(x).logits, model(x).logits, atol=1e-5, rtol=0)
    assert adapter_state(back).keys() == adapter_state(model).keys()


def test_all_trains_every_row_of_a_tied_embedding_and_saves_their_ids_for_peft(tmp_path):
    model = our_model("llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "base")
    vocab = model.config.vocab_size
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, trainable_token_indices="all"))
    assert model.lora_config.trainable_token_indices == list(range(vocab))
    assert model.embed_tokens.token_rows.shape == (vocab, model.config.hidden_size)
    x = ids(model)
    model(x).logits.logsumexp(-1).sum().backward()  # every output row gets a gradient through the softmax
    assert (model.embed_tokens.token_rows.grad.abs().sum(-1) > 0).all()
    with torch.no_grad():
        model.embed_tokens.token_rows.add_(torch.randn(model.embed_tokens.token_rows.shape,
                                                       generator=torch.Generator().manual_seed(0)))
    model.eval().save_pretrained(tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["trainable_token_indices"]
    assert written == list(range(vocab))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(model(x).logits, theirs(x).logits, atol=1e-4, rtol=0)
    for bad in ("every", {"embed_tokens": "all"}):
        with pytest.raises(ConfigError, match="trainable_token_indices"):
            LoraConfig(trainable_token_indices=bad)


def test_a_peft_written_token_adapter_loads_here_with_peft_s_logits(tmp_path):
    our_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False, trainable_token_indices=TOKENS))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "trainable_tokens_delta" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    theirs.save_pretrained(tmp_path / "adapter")
    theirs.eval()
    ours = Transformer.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter").eval()
    x = ids(ours)
    torch.testing.assert_close(ours(x).logits, theirs(x).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("lora", [dict(target_modules=["q_proj"], trainable_token_indices=TOKENS),
                                  dict(target_modules=["lm_head"])])
def test_the_training_loss_is_that_of_the_adapted_output_layer_and_trains_it(lora):
    """The fused loss reads the output layer's weight: it must be the one with the trained rows in, and a
    LoRA-adapted lm_head must not be fused past (its update would get no gradient)."""
    from astrai_pl.model import ModelConfig
    from astrai_pl.objectives import SFT

    torch.manual_seed(0)
    module = SFT(arch=ModelConfig.from_name("debug", tie_word_embeddings=True), lora=LoraConfig(r=4, **lora))
    trained = [p for p in module.model.parameters() if p.requires_grad and p.ndim == 2]
    with torch.no_grad():
        for p in trained:
            p.add_(torch.randn_like(p) * 0.5)  # off the base, so the loss tells the adapted head from the base's
    ids = torch.randint(0, 320, (2, 12))
    ids[:, 3] = 4
    loss, _ = module.next_token_loss({"input_ids": ids, "labels": ids})
    logits = module.model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 320), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    loss.backward()
    head = module.model.lm_head
    output_side = head.lora_B.weight if lora["target_modules"] == ["lm_head"] else module.model.embed_tokens.token_rows
    assert output_side.grad is not None and output_side.grad.abs().sum() > 0


def test_a_quoted_number_on_the_command_line_stays_a_token_string():
    """`["0", 4]`: the token "0" and the id 4; read as ids both, the run would train the wrong rows."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--lora", type=LoraConfig)
    lora = parser.instantiate_classes(parser.parse_args(["--lora", '{"trainable_token_indices": ["0", 4]}'])).lora
    assert lora.trainable_token_indices == ["0", 4]
    model = our_model("llama")
    apply_lora(model, lora, Tokenizer.byte_level())
    assert model.lora_config.trainable_token_indices == [4, Tokenizer.byte_level().token_to_id("0")]
