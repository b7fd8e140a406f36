from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from astrai_pl.data.packing import collate, pack_rows
from astrai_pl.data.preflight import check_bos_once, check_tokenizer, check_trained_tokens, describe_example
from astrai_pl.data.preprocess import preset_sections
from astrai_pl.data.synthetic import synthetic_dataset
from astrai_pl.data.tokenized import tokenize_dataset
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import Tokenizer


def test_synthetic_rows_to_a_packed_batch_and_a_masked_loss(tmp_path):
    tok, sections = Tokenizer.byte_level(), preset_sections("messages")
    check_tokenizer(tok, sections, vocab_size=320)
    encoded = tokenize_dataset(synthetic_dataset("sft", 200, cache_dir=str(tmp_path)), sections, tok)
    check_bos_once(encoded, tok, "synthetic")
    keep = check_trained_tokens(encoded, 128, "bfd", "right", source="synthetic")
    assert len(keep) == 200 and "[[" in describe_example(encoded, tok)
    packed, stats = pack_rows(encoded.select(keep), 128, "bfd")
    assert stats.tokens_kept == stats.tokens_in and stats.bins < 200
    loader = DataLoader(packed, batch_size=len(packed), collate_fn=partial(collate, pad_id=tok.pad_token_id))
    batch = next(iter(loader))
    # every trained token except a document's first is a target once, and only those
    expected = sum(sum(m[1:]) for m in encoded["loss_mask"])
    assert int((batch["labels"] != -100).sum()) == expected
    model = Transformer(ModelConfig.from_name("debug"))
    logits = model(
        batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"]
    ).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    assert torch.isfinite(loss)
