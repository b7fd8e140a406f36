import random

import pytest
import torch
from datasets import Dataset

from astrai_pl.data.packing import (
    IGNORE_INDEX,
    PackedDataset,
    best_fit_decreasing,
    collate,
    pack_example,
    pack_rows,
    plan_bins,
)


def random_rows(n, max_len, seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(1, max_len)
        rows.append(
            {
                "input_ids": [(i * 7 + t) % 250 + 5 for t in range(length)],
                "loss_mask": [rng.randint(0, 1) for _ in range(length)],
            }
        )
    return rows


def test_bfd_split_keeps_every_token_and_no_bin_exceeds_max_seq_len():
    rows = random_rows(300, 150)
    packed, stats = pack_rows(Dataset.from_list(rows), 64, "bfd_split")
    assert stats.split > 0 and stats.truncated == stats.dropped == 0 and stats.tokens_kept == stats.tokens_in
    for i in range(len(packed)):
        example = packed[i]
        assert len(example["input_ids"]) <= 64
        assert all(len(v) == len(example["input_ids"]) for v in example.values())
    pieces = {(span.row, span.start): span.stop for b in packed.bins for span in b}
    for r, row in enumerate(rows):  # the pieces of each row tile it exactly
        at = 0
        while at < len(row["input_ids"]):
            at = pieces.pop((r, at))
        assert at == len(row["input_ids"])
    assert not pieces
    all_tokens = sorted(t for i in range(len(packed)) for t in packed[i]["input_ids"])
    assert all_tokens == sorted(t for row in rows for t in row["input_ids"])


def test_best_fit_decreasing_picks_the_tightest_bin():
    assert best_fit_decreasing([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    sizes = [random.Random(1).randint(1, 50) for _ in range(500)]
    bins = best_fit_decreasing(sizes, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(sizes[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= -(-sum(sizes) // 64) * 1.25  # within 25% of the lower bound


def test_truncation_modes_and_counts():
    lengths = [3, 10, 5, 12]
    bins, stats = plan_bins(lengths, 8, "none", "right")
    assert [b[0][1:] for b in bins] == [(0, 3), (0, 8), (0, 5), (0, 8)] and stats.truncated == 2
    bins, stats = plan_bins(lengths, 8, "none", "left")
    assert [b[0][1:] for b in bins] == [(0, 3), (2, 10), (0, 5), (4, 12)]
    bins, stats = plan_bins(lengths, 8, "bfd", "drop")
    assert stats.dropped == 2 and sorted(s.row for b in bins for s in b) == [0, 2]
    assert stats.tokens_in - stats.tokens_kept == 22


def test_doc_reset_positions_restart_and_labels_stay_inside_documents():
    docs = [([10, 11, 12], [0, 1, 1]), ([20, 21], None), ([30, 31, 32, 33], [1, 1, 0, 1])]
    ex = pack_example(docs, "doc_reset")
    assert ex["input_ids"] == [10, 11, 12, 20, 21, 30, 31, 32, 33]
    assert ex["position_ids"] == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert ex["document_ids"] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    # aligned labels (the loss shifts); a document's first token is never a target
    assert ex["labels"] == [-100, 11, 12, -100, 21, -100, 31, -100, 33]
    assert pack_example(docs, "continuous")["position_ids"] == list(range(9))
    assert "position_ids" not in pack_example(docs, "none")


def test_collate_pads_with_its_own_document():
    a = pack_example([([5, 6, 7], None)], "doc_reset")
    b = pack_example([([8], None), ([9, 4], [1, 1])], "doc_reset")
    batch = collate([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 4]]
    c = pack_example([([8], None)], "doc_reset")
    batch = collate([a, c], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch["document_ids"].tolist() == [[0, 0, 0], [0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]


@pytest.mark.parametrize("position_mode", ["doc_reset", "none"])
def test_packed_documents_do_not_see_each_other_in_the_model(position_mode):
    from astrai_pl.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug")).eval()
    docs = [([5, 6, 7, 8], None), ([9, 10, 11], None)]
    batch = collate([pack_example(docs, position_mode)], pad_id=0)
    kwargs = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
    with torch.no_grad():
        packed = model(batch["input_ids"], **kwargs).logits[0]
        alone = [model(torch.tensor([ids])).logits[0] for ids, _ in docs]
    if position_mode == "doc_reset":
        torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    else:  # continuous positions: the first document is untouched by the second
        torch.testing.assert_close(packed[:4], alone[0], rtol=1e-5, atol=1e-5)


def test_packed_dataset_over_lists_matches_dataset_and_ignores_absent_mask():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    bins, _ = plan_bins([3, 2], 8, "bfd")
    from_list = PackedDataset(rows, bins)[0]
    from_ds = PackedDataset(Dataset.from_list(rows), bins)[0]
    assert from_list == from_ds and from_ds["labels"] == [-100, 2, 3, -100, 5]
    assert IGNORE_INDEX == -100
