"""ResumableSampler: resuming at the same data-parallel size gives the same
batches; at another size every sample of the epoch is seen exactly once.

W ranks are simulated in one process (samplers built with rank=, world=;
their state_dicts merged as a distributed save merges them); one test runs
the real thing over gloo through tensorckpt.save / load (world 2 -> 3).
"""

from __future__ import annotations

import collections
import itertools
import os
import sys

import pytest
from torch.utils.data import DataLoader

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402
from tensorckpt import ResumableSampler  # noqa: E402
from tensorckpt.data import epoch_order  # noqa: E402


def ranks(world: int, n: int, **kw) -> list[ResumableSampler]:
    return [ResumableSampler(n, rank=r, world=world, **kw) for r in range(world)]


def merged(samplers) -> dict:
    """What a distributed save stores: the shared part, every rank's part."""
    out = samplers[0].state_dict()
    out["rank"] = {k: v for s in samplers for k, v in s.state_dict()["rank"].items()}
    return out


def resume(state: dict, world: int, n: int, **kw) -> list[ResumableSampler]:
    out = ranks(world, n, **kw)
    for s in out:
        s.load_state_dict(state)
    return out


def take(s: ResumableSampler, batches: int, batch_size: int) -> list[int]:
    """One rank's training loop consumes ``batches`` batches."""
    got = list(itertools.islice(iter(s), batches * batch_size))
    s.advance(len(got))
    return got


def rest_of_epoch(samplers) -> list[int]:
    seen = []
    for s in samplers:
        seen += list(s)
        s.advance(len(s))
    return seen


def assert_exactly_once(seen: list[int], n: int) -> None:
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(n)), f"missing: {sorted(set(range(n)) - set(counts))}"
    assert max(counts.values()) == 1, f"seen twice: {[i for i, c in counts.items() if c > 1]}"


def assert_full_epochs(samplers, n: int, epochs=(1, 2)) -> None:
    """Following epochs are full permutations, split over the ranks."""
    for e in epochs:
        seen = []
        for s in samplers:
            s.set_epoch(e)
            seen += list(s)
        assert_exactly_once(seen, n)
        assert seen != sorted(seen)


# ------------------------------------------------------------------ order


def test_epoch_order_is_the_specified_permutation():
    # golden: spec/rng-and-data.md defines this order; a change breaks every resume in flight
    assert epoch_order(10, seed=0, epoch=0).tolist() == GOLDEN_0_0
    assert epoch_order(10, seed=0, epoch=1).tolist() != GOLDEN_0_0
    assert epoch_order(10, seed=1, epoch=0).tolist() != GOLDEN_0_0
    assert sorted(epoch_order(1000, 7, 3).tolist()) == list(range(1000))
    assert epoch_order(5, 0, 0, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    assert epoch_order(0, 0, 0).tolist() == []


GOLDEN_0_0 = [0, 3, 5, 7, 9, 6, 2, 8, 1, 4]  # also in the spec's example


def _spec_order(n: int, seed: int, epoch: int) -> list[int]:
    """The spec's definition, in plain Python integers."""
    m = 2**64 - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    k = mix(mix(seed) ^ epoch)
    return sorted(range(n), key=lambda i: (mix((k + i * 0x9E3779B97F4A7C15) & m), i))


def test_epoch_order_matches_plain_python_definition():
    for n, seed, epoch in ((10, 0, 0), (33, 2**63 + 5, 7), (257, 12345, 0)):
        assert epoch_order(n, seed, epoch).tolist() == _spec_order(n, seed, epoch)


def test_ranks_split_an_epoch_without_padding():
    samplers = ranks(4, 10)
    assert [len(s) for s in samplers] == [3, 3, 2, 2]
    assert_exactly_once(rest_of_epoch(samplers), 10)
    assert [len(s) for s in ranks(4, 10, drop_last=True)] == [2, 2, 2, 2]


# -------------------------------------------------------- same world: exact


def loader(sampler, batch_size: int, **kw) -> DataLoader:
    return DataLoader(list(range(sampler.num_samples)), batch_size=batch_size, sampler=sampler, **kw)


def batches(sampler, batch_size: int, epochs, stop_after: int | None = None, **kw) -> list[list[int]]:
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        for b in sampler.track(loader(sampler, batch_size, **kw)):
            out.append(b.tolist())
            if stop_after is not None and len(out) == stop_after:
                return out
    return out


@pytest.mark.parametrize("world,n,stop", [(1, 23, 4), (3, 50, 5), (3, 50, 9), (4, 10, 1)])
def test_same_world_resume_yields_the_uninterrupted_batches(world, n, stop):
    B = 3
    whole = [batches(s, B, epochs=(0, 1)) for s in ranks(world, n, seed=11)]
    first = ranks(world, n, seed=11)
    before = [batches(s, B, epochs=(0,), stop_after=stop) for s in first]
    state = merged(first)
    after = resume(state, world, n, seed=999)  # the checkpoint's seed wins
    for r, s in enumerate(after):
        assert s.epoch == 0
        got = before[r] + batches(s, B, epochs=range(s.epoch, 2))
        assert got == whole[r], f"rank {r}"


def test_prefetched_batches_are_not_counted():
    B, n = 2, 40
    s = ResumableSampler(n, seed=3)
    whole = batches(ResumableSampler(n, seed=3), B, epochs=(0,))
    it = s.track(loader(s, B, num_workers=2, prefetch_factor=4))
    got = [next(it).tolist() for _ in range(3)]  # the workers have fetched well beyond these
    assert s.state_dict()["rank"] == {"0": {"consumed": 3 * B}}
    it.close()
    again = ResumableSampler(n)
    again.load_state_dict(s.state_dict())
    assert got + batches(again, B, epochs=(0,)) == whole


def test_track_checks_the_loader():
    s = ResumableSampler(8)
    with pytest.raises(ValueError, match="not this sampler"):
        next(s.track(DataLoader(list(range(8)), sampler=ResumableSampler(8))))
    with pytest.raises(ValueError, match="advance"):
        next(s.track(DataLoader(list(range(8)), batch_size=None, sampler=s)))


# ------------------------------------------------- other world: exactly once


@pytest.mark.parametrize(
    "before,after,n,steps,extra",
    [
        (4, 2, 37, 2, {}),  # uneven: 37 over 4 ranks
        (2, 3, 29, 3, {1: 1}),  # rank 1 consumed one batch more than rank 0
        (3, 2, 11, 1, {0: 5}),  # rank 0 finished its slice (4 samples), the others did not
        (4, 1, 10, 0, {}),  # nothing consumed yet
        (2, 4, 10, 5, {}),  # epoch already complete
    ],
)
def test_other_world_sees_every_sample_exactly_once(before, after, n, steps, extra):
    B = 2
    first = ranks(before, n, seed=5)
    seen = [x for r, s in enumerate(first) for x in take(s, steps + extra.get(r, 0), B)]
    second = resume(merged(first), after, n)
    assert sum(len(s) for s in second) == n - len(seen)
    seen += rest_of_epoch(second)
    assert_exactly_once(seen, n)
    assert_full_epochs(second, n)


def test_several_world_changes_in_one_epoch():
    n, B = 101, 3
    first = ranks(4, n, seed=8)
    seen = [x for s in first for x in take(s, 2, B)]
    second = resume(merged(first), 2, n)
    seen += [x for r, s in enumerate(second) for x in take(s, 3 + r, B)]
    third = resume(merged(second), 3, n)
    assert len(third[0].state_dict()["segments"]) == 2
    fourth = resume(merged(third), 3, n)  # same world again: continues exactly
    assert [list(s) for s in fourth] == [list(s) for s in third]
    seen += rest_of_epoch(fourth)
    assert_exactly_once(seen, n)
    assert_full_epochs(fourth, n)
    assert fourth[0].state_dict()["segments"] == []


def test_drop_last_gives_equal_slices_and_at_most_once():
    n = 23
    first = ranks(3, n, drop_last=True)
    seen = [x for s in first for x in take(s, 2, 2)]
    second = resume(merged(first), 2, n, drop_last=True)
    assert len({len(s) for s in second}) == 1
    seen += rest_of_epoch(second)
    assert max(collections.Counter(seen).values()) == 1
    assert len(seen) >= n - (3 - 1) - (2 - 1)


# ------------------------------------------------------ through save / load


def test_save_load_layout_and_resume(mem_url):
    url = mem_url()
    s = ResumableSampler(20, seed=4)
    s.set_epoch(2)
    take(s, 3, 2)
    tensorckpt.save({"data": s, "step": 3}, url)
    ck = tensorckpt.open(url)
    assert sorted(ck.keys()) == sorted(
        f"data/{k}" for k in ("version", "num_samples", "seed", "shuffle", "epoch", "world", "segments", "rank/0/consumed")
    ) + ["step"]
    again = ResumableSampler(20)
    tensorckpt.load({"data": again, "step": 0}, url)
    assert again.epoch == 2 and list(again) == list(s)


def test_load_errors_name_the_key(mem_url):
    url = mem_url()
    s = ResumableSampler(20)
    take(s, 1, 2)
    tensorckpt.save({"data": s}, url)
    with pytest.raises(tensorckpt.IncompatibleStateError, match=r"'data'.*20 samples.*has 21"):
        tensorckpt.load({"data": ResumableSampler(21)}, url)
    with pytest.raises(tensorckpt.IncompatibleStateError, match="data/rank/0/consumed"):
        tensorckpt.load({"other": ResumableSampler(20)}, url)
    untouched = ResumableSampler(20, seed=1)
    with pytest.warns(UserWarning):
        tensorckpt.load({"other": untouched}, url, strict=False)
    assert untouched.seed == 1 and len(untouched) == 20


def test_state_without_every_rank_or_with_bad_counts_is_rejected():
    first = ranks(3, 20)
    one = first[0].state_dict()
    with pytest.raises(tensorckpt.IncompatibleStateError, match=r"ranks \[1, 2\].*merge"):
        ResumableSampler(20).load_state_dict(one)
    bad = merged(first)
    bad["rank"]["2"]["consumed"] = 7  # rank 2 of 3 has 6 samples of 20
    with pytest.raises(tensorckpt.CorruptCheckpointError, match="counts more samples"):
        ResumableSampler(20).load_state_dict(bad)
    bad = merged(first) | {"segments": [[2, [1]]]}
    with pytest.raises(tensorckpt.CorruptCheckpointError, match="segment"):
        ResumableSampler(20).load_state_dict(bad)


# ---------------------------------------------------------------- over gloo

N, B = 29, 2


def gloo_save(rank: int, world: int, path: str) -> list[int]:
    s = ResumableSampler(N, seed=21)
    s.set_epoch(1)
    seen = []
    for i, b in enumerate(s.track(loader(s, B))):
        seen += b.tolist()
        if i == 2 + rank:  # ranks stop after different numbers of batches: uneven counts
            break
    tensorckpt.save({"data": s, "step": 3}, path)
    return seen


def gloo_load(rank: int, world: int, path: str) -> tuple[list[int], list[int]]:
    s = ResumableSampler(N, seed=0)
    tensorckpt.load({"data": s, "step": 0}, path)
    assert s.epoch == 1
    rest = [x for b in s.track(loader(s, B)) for x in b.tolist()]
    s.set_epoch(2)
    return rest, list(s)


def test_gloo_resume_two_ranks_on_three(tmp_path):
    path = str(tmp_path / "ckpt")
    before = dist.run(2, gloo_save, path)
    after = dist.run(3, gloo_load, path)
    assert_exactly_once([x for seen in before for x in seen] + [x for rest, _ in after for x in rest], N)
    assert_exactly_once([x for _, nxt in after for x in nxt], N)
    ck = tensorckpt.open(path)
    assert ck.read("data/rank/0/consumed") == 3 * B and ck.read("data/rank/1/consumed") == 4 * B
