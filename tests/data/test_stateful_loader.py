import functools

import pytest

from astrai_pl.data.sampling import ResumeMismatchError, StatefulLoader, shuffled_batches


def test_two_ranks_train_on_the_samples_of_one_process_with_twice_the_batch():
    single = shuffled_batches(50, 8, epoch=3, seed=7)
    ranks = [shuffled_batches(50, 4, epoch=3, seed=7, rank=r, world_size=2) for r in range(2)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 6
    assert [a + b for a, b in zip(*ranks)] == single


def test_order_is_seeded_by_seed_and_epoch():
    assert shuffled_batches(40, 4, 0, seed=1) == shuffled_batches(40, 4, 0, seed=1)
    assert shuffled_batches(40, 4, 0, seed=1) != shuffled_batches(40, 4, 1, seed=1)
    assert shuffled_batches(40, 4, 0, seed=1) != shuffled_batches(40, 4, 0, seed=2)
    assert shuffled_batches(10, 4, 0, shuffle=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_without_drop_last_every_rank_gets_the_same_number_of_batches():
    ranks = [shuffled_batches(11, 4, 0, drop_last=False, rank=r, world_size=3) for r in range(3)]
    assert {len(b) for b in ranks} == {1}
    assert {i for b in ranks for batch in b for i in batch} == set(range(11))


def _loader(n=10, batch_size=3):
    plan = functools.partial(shuffled_batches, n, batch_size, seed=0)
    return StatefulLoader(list(range(n)), plan, collate_fn=list)


def test_a_loaded_position_continues_exactly_across_epochs():
    reference = _loader()
    expected = [b for _ in range(3) for b in reference]  # 3 epochs of 3 batches
    interrupted = _loader()
    seen = list(interrupted)  # one epoch
    seen.append(next(iter(interrupted)))  # and one batch of the next
    state = interrupted.state_dict()
    assert state == {"epoch": 1, "batches": 1, "num_batches": 3}
    resumed = _loader()
    resumed.load_state_dict(state)
    seen += list(resumed) + list(resumed)
    assert seen == expected


def test_the_end_of_an_epoch_resumes_at_the_next_one():
    loader = _loader()
    list(loader)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batches"] == 0


def test_calling_iter_without_taking_a_batch_changes_nothing():
    loader = _loader()
    iter(loader)  # Lightning does this once to check the loader is iterable
    assert list(loader) == list(_loader())


def test_a_position_from_different_data_is_refused():
    loader = _loader(n=10)
    with pytest.raises(ResumeMismatchError, match=r"had 5 batches per epoch.*this run has 3.*batch_size"):
        loader.load_state_dict({"epoch": 0, "batches": 2, "num_batches": 5})
