"""The pair objectives' prompt-sharing forward (objectives/shared_prompt.py): the tree layout, states equal to the
plain (2B, T) forward's for every attention family (sliding windows, soft-capping, longrope, post-norm), the same
gradients, and the plain batch where the tree would not pay."""

import pytest
import torch

from astrai_pl.data.dpo import collate_pairs
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives.dpo import pair_logps
from astrai_pl.objectives.shared_prompt import needed_lengths, pair_hidden_states, pair_tree, tree_pays


def pair_rows(prompt_lengths, chosen_lengths, rejected_lengths, seed=0, vocab=200):
    """Pairs sharing a random prompt; responses random, scored from the prompt's end."""
    gen, rows = torch.Generator().manual_seed(seed), []
    for p, c, r in zip(prompt_lengths, chosen_lengths, rejected_lengths):
        prompt = torch.randint(4, vocab, (p,), generator=gen).tolist()
        chosen, rejected = (prompt + torch.randint(4, vocab, (n,), generator=gen).tolist() for n in (c, r))
        rows.append(dict(chosen_input_ids=chosen, rejected_input_ids=rejected, prompt_length=p,
                         chosen_loss_mask=[0] * p + [1] * c, rejected_loss_mask=[0] * p + [1] * r))
    return rows


def plain_states(model, batch):
    return model.hidden_states(torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]]))[0]


def scored(batch):
    return torch.cat([batch["chosen_labels"], batch["rejected_labels"]]) != -100


def test_the_tree_lays_out_trunk_chosen_rest_rejected_rest_and_maps_every_position_back():
    chosen = torch.tensor([[5, 6, 7, 8, 0], [5, 9, 9, 9, 9]])
    rejected = torch.tensor([[5, 6, 1, 0, 0], [5, 9, 2, 0, 0]])
    tree = pair_tree(chosen, rejected, torch.tensor([4, 5]), torch.tensor([3, 3]))
    # pair 0: trunk [5 6], chosen rest [7 8], rejected rest [1]; pair 1: trunk [5 9], [9 9 9], [2]
    assert tree.input_ids.tolist() == [[5, 6, 7, 8, 1, 0], [5, 9, 9, 9, 9, 2]]
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 2, 0], [0, 1, 2, 3, 4, 2]]
    assert tree.branch_ids.tolist() == [[0, 0, 1, 1, 2, 3], [0, 0, 1, 1, 1, 2]]
    flat = tree.input_ids.flatten()
    for side, (ids, lengths) in enumerate(((chosen, [4, 5]), (rejected, [3, 3]))):
        for b in range(2):
            n = lengths[b]
            assert flat[tree.gather[side * 2 + b, :n]].tolist() == ids[b, :n].tolist()


def test_needed_lengths_reach_the_last_scored_label():
    labels = torch.tensor([[-100, 4, 5, -100, -100], [-100, -100, -100, -100, -100]])
    assert needed_lengths(labels).tolist() == [3, 1]


@pytest.mark.parametrize("preset", ["debug", "gemma2-debug", "gemma3-debug", "phi3-debug", "olmo2-debug"])
def test_the_tree_gives_the_states_of_the_plain_forward(preset):
    torch.manual_seed(0)
    overrides = dict(sliding_window=6) if preset == "debug" else {}  # a window shorter than every prompt
    model = Transformer(ModelConfig.from_name(preset, **overrides)).eval()
    # ragged prompts and responses; pair 2's responses start alike, so its trunk runs past its prompt
    rows = pair_rows([24, 30, 18], [20, 9, 24], [12, 22, 24], seed=1)
    rows[2]["rejected_input_ids"][18:20] = rows[2]["chosen_input_ids"][18:20]
    batch = collate_pairs(rows, pad_id=0, max_seq_len=64)
    with torch.no_grad():
        assert tree_pays(model.config, 3, batch["chosen_input_ids"].shape[1], 24 + 20 + 12)
        tree, plain = pair_hidden_states(model, batch), plain_states(model, batch)
    used = scored(batch)
    torch.testing.assert_close(tree[used], plain[used], rtol=1e-4, atol=1e-5)


def test_the_tree_takes_the_gradients_of_the_plain_forward():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug"))
    batch = collate_pairs(pair_rows([40, 33], [16, 24], [24, 10], seed=2), pad_id=0, max_seq_len=80)

    def grads(logps):
        model.zero_grad()
        chosen, rejected = logps()
        (chosen - 2 * rejected).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, chosen.detach(), rejected.detach()

    def plain():  # the (2B, T) forward pair_logps ran before it shared prompts
        from astrai_pl.objectives.logprobs import sequence_logprobs, token_logprobs

        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        return sequence_logprobs(token_logprobs(model, ids, labels)).chunk(2)

    ours, theirs = grads(lambda: pair_logps(model, batch)), grads(plain)
    torch.testing.assert_close(ours[1:], theirs[1:], rtol=1e-5, atol=1e-5)
    for name in ours[0]:
        torch.testing.assert_close(ours[0][name], theirs[0][name], rtol=1e-4, atol=1e-6, msg=name)


def calls_with_branches(model, batch, monkeypatch):
    seen = []
    inner = model.hidden_states

    def spy(*args, **kwargs):
        seen.append(kwargs.get("branch_ids") is not None)
        return inner(*args, **kwargs)

    monkeypatch.setattr(model, "hidden_states", spy)
    with torch.no_grad():
        pair_hidden_states(model, batch)
    return seen


def test_short_shared_prompts_and_recurrent_models_keep_the_plain_batch(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug")).eval()
    long_prompts = collate_pairs(pair_rows([48, 48], [16, 16], [16, 16]), pad_id=0, max_seq_len=64)
    short_prompts = collate_pairs(pair_rows([2, 2], [40, 40], [40, 40]), pad_id=0, max_seq_len=64)
    assert calls_with_branches(model, long_prompts, monkeypatch) == [True]
    assert calls_with_branches(model, short_prompts, monkeypatch) == [False]
    rwkv = Transformer(ModelConfig.from_name("rwkv-debug")).eval()
    assert calls_with_branches(rwkv, long_prompts, monkeypatch) == [False]


def test_branch_ids_are_refused_where_there_is_no_mask_to_branch_with():
    model = Transformer(ModelConfig.from_name("rwkv-debug"))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="branch_ids"):
        model.hidden_states(ids, position_ids=torch.arange(4)[None], branch_ids=torch.zeros_like(ids))


@pytest.mark.parametrize("prompt", [48, 2])  # the tree, then the plain batch
def test_the_states_at_one_position_per_sequence_equal_the_full_states_there(prompt):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug")).eval()
    batch = collate_pairs(pair_rows([prompt, prompt], [16, 9], [12, 20], seed=3), pad_id=0, max_seq_len=80)
    at = torch.tensor([prompt + 15, prompt + 3, prompt + 11, prompt + 19])
    with torch.no_grad():
        full, few = pair_hidden_states(model, batch), pair_hidden_states(model, batch, at=at)
    torch.testing.assert_close(few, full[torch.arange(4), at], rtol=1e-4, atol=1e-5)


def test_an_empty_batch_gives_empty_states():
    model = Transformer(ModelConfig.from_name("debug")).eval()
    batch = collate_pairs(pair_rows([40], [8], [8]), pad_id=0, max_seq_len=64)
    empty = {k: v[:0] for k, v in batch.items()}
    with torch.no_grad():
        assert pair_hidden_states(model, empty).shape == (0, 48, model.config.hidden_size)
