"""End to end: a training run interrupted and resumed under other layouts
continues as if it had never stopped.

A small float64 MLP is trained with FSDP2 (``fully_shard`` over gloo on CPU),
AdamW, OneCycleLR (it changes the LR *and* AdamW's beta1 every step, so the
param groups must come back exactly), a ``tensorckpt.ResumableSampler`` over
a synthetic dataset (global batch 12: 3 per rank at world 4, 6 at world 2, 4
at world 3) and a dropout whose mask comes from torch's global generator.
Two epochs of 8 steps, 16 steps in all. Each world is spawned once:

    world 4   (a) uninterrupted, steps 1..16: the reference
              (b) a fresh run to step 5 (mid epoch 0), tensorckpt.save, "crash"
    world 2   (c) new objects (other init), load step 5, train on to 16; at
              step 11 (mid epoch 1) tensorckpt.async_save, then wait on it
    world 3   (d) new objects, load step 5, train on to 16
              (e) new objects, load step 11 (saved at world 2), train on to 16

For (c) and (d) the parent compares, step by step, against (a): the global
batch (the same sample indices), the global loss, the LR and betas, the
random draws of torch / numpy / Python; then the parameters and AdamW moments
(full tensors) at step 16. Loading itself is exact: what a rank holds right
after ``load`` equals bit for bit what was saved. Along each chain of runs
(4 -> 2, 4 -> 3, 4 -> 2 -> 3) every sample index of each epoch is consumed
exactly once. (e) grows the world: rank 2 has no saved generators and gets
the derived seed of spec/rng-and-data.md 2.3, so its dropout masks differ
from the reference's and (e)'s losses are not compared; its batches, LR and
ranks 0-1's random draws are.

Random numbers: every rank seeds its generators alike, and the loop draws a
fixed number of values per step whatever the per-rank batch (one dropout mask
over hidden features, shared by the whole global batch, plus one numpy and
one Python draw). So the streams do not depend on the layout, and the resumed
ranks of (c) and (d) (all < the saving world) get them back from their own
rows of ``rng_state()``. The DataLoader has a generator of its own (see
``setup``). Per-element dropout (``nn.Dropout``) would draw one number
per local element, a count that depends on the per-rank batch, so no layout
change could reproduce it; the mask above is what keeps the comparison
meaningful. Without restoring ``rng``, the masks after a resume would differ
and the losses with them.

Tolerances: sample indices, LR, betas and random draws are compared exactly,
and so is the first loss after each resume (the parameters are bit-exact and
each sample's forward does not depend on its batch-mates). Later losses,
parameters and moments are compared with rtol ``RTOL`` (1e-9; for tensors
plus an atol of ``RTOL`` times the tensor's largest magnitude, for elements
near 0): the gradient of the global mean loss is summed in another order at
another world size (a mean over 3 local samples then a reduce-scatter over 4
ranks, versus 6 samples and 2 ranks), so the runs differ by float64
rounding. Observed: losses within 5e-16 relative, the worst element of any
parameter or moment within 2e-12 relative after 11 steps.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import numpy as np
import pytest
import torch
from torch import nn

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402

SEED = 1234
N_SAMPLES = 96
GLOBAL_BATCH = 12
EPOCHS = 2
STEPS_PER_EPOCH = N_SAMPLES // GLOBAL_BATCH  # 8
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 16
FIRST_SAVE = 5  # world 4, mid epoch 0
SECOND_SAVE = 11  # world 2, mid epoch 1
RTOL = 1e-9  # see the module docstring
MOMENTS = ("exp_avg", "exp_avg_sq")


class Data(torch.utils.data.Dataset):
    """Deterministic synthetic regression data; items carry their index."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N_SAMPLES, 8, generator=g, dtype=torch.float64)
        w = torch.randn(8, 2, generator=g, dtype=torch.float64)
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.randn(N_SAMPLES, 2, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class FeatureDropout(nn.Module):
    """Dropout with one mask over features per step, drawn from torch's global
    generator: the same number of draws whatever the batch size."""

    def __init__(self, features: int, p: float) -> None:
        super().__init__()
        self.features, self.p = features, p

    def forward(self, x):
        if not self.training:
            return x
        keep = torch.rand(self.features, dtype=x.dtype) >= self.p
        self.last_mask = keep.tolist()
        return x * keep.to(x.dtype) / (1 - self.p)


def build(seed: int, world: int) -> nn.Module:
    torch.manual_seed(seed)  # 16, 16, 2 rows: uneven shards at world 3
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), FeatureDropout(16, 0.25), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    ).to(torch.float64)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def setup(seed: int, world: int):
    """Model, AdamW, OneCycleLR, sampler and loader, seeded like a real run
    (every generator seeded alike on every rank)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = build(seed, world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=TOTAL_STEPS, pct_start=0.25)
    data = Data()
    sampler = tensorckpt.ResumableSampler(data, seed=SEED)
    # The loader gets a generator of its own: creating a DataLoader iterator draws
    # a base seed (for its workers) from the generator it is given, by default
    # torch's global one. A resumed run creates one more iterator mid-epoch than
    # the uninterrupted run did, which would shift the global stream by one draw
    # and change every dropout mask after the resume.
    loader = torch.utils.data.DataLoader(
        data, batch_size=GLOBAL_BATCH // world, sampler=sampler, generator=torch.Generator().manual_seed(seed)
    )
    return model, opt, sched, sampler, loader


def full(t) -> np.ndarray:
    """The whole tensor as numpy (tensors returned by workers would travel as
    shared memory that dies with the worker)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def snapshot(model, opt) -> dict:
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        for m in MOMENTS:
            if m in opt.state.get(p, {}):
                out[f"{name}/{m}"] = full(opt.state[p][m])
    return out


def train(model, opt, sched, sampler, loader, step: int, stop: int, on_step=None) -> list[dict]:
    """Steps ``step + 1 .. stop``; one record per step."""
    records = []
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for idx, x, y in sampler.track(loader):
            step += 1
            group = opt.param_groups[0]
            rec = {"step": step, "epoch": epoch, "lr": group["lr"], "beta1": group["betas"][0]}
            per_sample = ((model(x) - y) ** 2).mean(dim=1)
            rec["mask"] = model[2].last_mask
            rec["np"], rec["py"] = float(np.random.random()), random.random()
            per_sample.mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            rec["idx"] = idx.tolist()
            rec["loss"] = per_sample.detach().tolist()
            records.append(rec)
            if on_step is not None:
                on_step(step)
            if step == stop:
                return records
    return records


def state(model, opt, sched, sampler, step: int) -> dict:
    return {"model": model, "optim": opt, "sched": sched, "data": sampler, "rng": tensorckpt.rng_state(), "step": step}


def world4(rank: int, world: int, base: str) -> dict:
    # (a) the reference, uninterrupted
    model, opt, sched, sampler, loader = setup(SEED, world)
    reference = train(model, opt, sched, sampler, loader, 0, TOTAL_STEPS)
    reference_end = snapshot(model, opt)

    # (b) a run that saves at FIRST_SAVE and then "crashes" (its objects are dropped)
    model, opt, sched, sampler, loader = setup(SEED, world)
    first = train(model, opt, sched, sampler, loader, 0, FIRST_SAVE)
    tensorckpt.save(state(model, opt, sched, sampler, FIRST_SAVE), f"{base}/step-{FIRST_SAVE}")
    saved = snapshot(model, opt)
    return {"reference": reference, "reference_end": reference_end, "first": first, "saved": saved}


def resume(world: int, base: str, start: int, save_at: int | None = None) -> dict:
    """Load step ``start`` into new objects (another init: load must replace
    it) and train on to the end; ``async_save`` at step ``save_at``."""
    model, opt, sched, sampler, loader = setup(SEED + 1 + world, world)
    st = state(model, opt, sched, sampler, 0)
    tensorckpt.load(st, f"{base}/step-{start}")
    loaded = snapshot(model, opt)
    handles, saved = [], {}

    def on_step(step):
        if step == save_at:  # asynchronous: training goes on (changing the tensors) while it is written
            handles.append(tensorckpt.async_save(state(model, opt, sched, sampler, step), f"{base}/step-{step}"))
            saved.update(snapshot(model, opt))

    records = train(model, opt, sched, sampler, loader, st["step"], TOTAL_STEPS, on_step)
    for h in handles:
        h.wait()
    return {"step": st["step"], "loaded": loaded, "records": records, "end": snapshot(model, opt), "saved": saved}


def world2(rank: int, world: int, base: str) -> dict:
    # (c) 4 -> 2 at step 5, to the end; an async save at step 11
    return resume(world, base, FIRST_SAVE, SECOND_SAVE)


def world3(rank: int, world: int, base: str) -> dict:
    # (d) 4 -> 3 at step 5, to the end
    shrink = resume(world, base, FIRST_SAVE)
    # (e) 2 -> 3 at step 11 (the async checkpoint): rank 2 has no saved row
    grow = resume(world, base, SECOND_SAVE)
    return {"shrink": shrink, "grow": grow}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("resume"))
    w4 = dist.run(4, world4, base)
    w2 = dist.run(2, world2, base)
    w3 = dist.run(3, world3, base)
    return {"base": base, "w4": w4, "w2": w2, "w3": [r["shrink"] for r in w3], "grow": [r["grow"] for r in w3]}


# ------------------------------------------------------------------ helpers


def by_step(per_rank: list[list[dict]]) -> dict[int, list[dict]]:
    """Records of all ranks, by step (ranks in order)."""
    out: dict[int, list[dict]] = {}
    for records in per_rank:
        for rec in records:
            out.setdefault(rec["step"], []).append(rec)
    return out


def global_batch(recs: list[dict]) -> list[int]:
    return sorted(i for r in recs for i in r["idx"])


def global_loss(recs: list[dict]) -> float:
    """Mean per-sample loss over the global batch, summed in sample-index order
    (the same order whatever the layout)."""
    pairs = sorted((i, loss) for r in recs for i, loss in zip(r["idx"], r["loss"]))
    return float(np.mean(np.array([loss for _, loss in pairs], dtype=np.float64)))


def reference(runs) -> dict[int, list[dict]]:
    return by_step([r["reference"] for r in runs["w4"]])


def resumes(runs):
    """(name, results by rank) of the resumes that must match the reference."""
    return [("4 -> 2", runs["w2"]), ("4 -> 3", runs["w3"])]


def derived_seed(rank0_torch_row: np.ndarray, rank: int) -> int:
    """spec/rng-and-data.md 2.3, written out here from the spec."""
    tag = b"tensorckpt/rng/v1\x00"
    digest = hashlib.sha256(tag + rank0_torch_row.astype(np.uint8).tobytes() + rank.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little")


# -------------------------------------------------------------------- tests


def test_checkpoints_hold_the_training_state(runs):
    ck = tensorckpt.open(f"{runs['base']}/step-{FIRST_SAVE}")
    assert ck.metadata.world_size == 4
    keys = set(ck.keys())
    assert {"step", "data/epoch", "data/world", "data/rank/3/consumed", "optim/class", "sched/last_epoch",
            "rng/torch", "rng/numpy", "rng/python", "model/0.weight", "optim/state/0.weight/exp_avg"} <= keys
    assert ck.read("step") == FIRST_SAVE and ck.read("sched/last_epoch") == FIRST_SAVE
    assert ck.read("data/world") == 4 and ck.read("data/epoch") == 0 and ck.read("data/segments") == []
    assert [ck.read(f"data/rank/{r}/consumed") for r in range(4)] == [FIRST_SAVE * 3] * 4
    assert ck.info("rng/torch").shape[0] == 4
    assert ck.read("optim/state/0.weight/step") == float(FIRST_SAVE)
    saved = runs["w4"][0]["saved"]
    assert np.array_equal(ck.read("optim/state/3.weight/exp_avg_sq").numpy(), saved["3.weight/exp_avg_sq"])
    # the async save at world 2, in epoch 1 (3 steps of 6 samples per rank into it)
    ck2 = tensorckpt.open(f"{runs['base']}/step-{SECOND_SAVE}")
    assert ck2.metadata.world_size == 2 and ck2.read("step") == SECOND_SAVE
    assert ck2.read("data/world") == 2 and ck2.read("data/epoch") == 1 and ck2.read("data/segments") == []
    consumed = (SECOND_SAVE - STEPS_PER_EPOCH) * GLOBAL_BATCH // 2
    assert [ck2.read(f"data/rank/{r}/consumed") for r in range(2)] == [consumed] * 2


def test_interrupted_run_matches_reference_before_the_save(runs):
    ref = reference(runs)
    first = by_step([r["first"] for r in runs["w4"]])
    assert sorted(first) == list(range(1, FIRST_SAVE + 1))
    for step, recs in first.items():
        assert recs == ref[step], step  # same layout, same seeds: identical to the last bit


def test_load_is_bit_exact(runs):
    saved = runs["w4"][0]["saved"]
    for name, results in resumes(runs):
        for rank, r in enumerate(results):
            assert r["step"] == FIRST_SAVE
            assert r["loaded"].keys() == saved.keys()
            for k, v in saved.items():
                assert np.array_equal(r["loaded"][k], v), f"{name} rank {rank}: {k}"
    # the async save at step 11 (world 2) holds what the tensors were when it was called
    saved = runs["w2"][0]["saved"]
    for rank, r in enumerate(runs["grow"]):
        assert r["step"] == SECOND_SAVE and r["loaded"].keys() == saved.keys()
        for k, v in saved.items():
            assert np.array_equal(r["loaded"][k], v), f"2 -> 3 rank {rank}: {k}"


def test_same_batches_lr_and_random_draws(runs):
    ref = reference(runs)
    for name, results in resumes(runs):
        got = by_step([r["records"] for r in results])
        assert sorted(got) == list(range(FIRST_SAVE + 1, TOTAL_STEPS + 1)), name
        for step, recs in got.items():
            want = ref[step]
            assert global_batch(recs) == global_batch(want), f"{name} step {step}: other samples"
            for rank, rec in enumerate(recs):  # resumed rank r continues saved rank r's generators
                w = want[rank]
                assert rec["epoch"] == w["epoch"], f"{name} step {step}"
                assert (rec["lr"], rec["beta1"]) == (w["lr"], w["beta1"]), f"{name} step {step} rank {rank}"
                draws, want_draws = (rec["mask"], rec["np"], rec["py"]), (w["mask"], w["np"], w["py"])
                assert draws == want_draws, f"{name} step {step} rank {rank}"


def test_losses_match_the_uninterrupted_run(runs):
    ref = reference(runs)
    want = [global_loss(ref[s]) for s in range(FIRST_SAVE + 1, TOTAL_STEPS + 1)]
    for name, results in resumes(runs):
        got = by_step([r["records"] for r in results])
        losses = [global_loss(got[s]) for s in range(FIRST_SAVE + 1, TOTAL_STEPS + 1)]
        assert losses[0] == want[0], f"{name}: the first step after the resume is not exact"
        np.testing.assert_allclose(losses, want, rtol=RTOL, atol=0, err_msg=name)


def test_parameters_and_moments_at_the_end(runs):
    want = runs["w4"][0]["reference_end"]
    for name, results in resumes(runs):
        for rank, r in enumerate(results):
            got = r["end"]
            assert got.keys() == want.keys() and any(k.endswith("exp_avg_sq") for k in want)
            for k, v in want.items():
                atol = RTOL * float(np.abs(v).max())
                np.testing.assert_allclose(got[k], v, rtol=RTOL, atol=atol, err_msg=f"{name} rank {rank}: {k}")


def test_every_sample_once_per_epoch(runs):
    """Epoch 0: world 4 (steps 1..5), then world 2 or 3 (6..8). Epoch 1: world 2
    (9..11), then world 3 (12..16) from the async checkpoint. Every index of an
    epoch is consumed exactly once along each chain."""
    first = by_step([r["first"] for r in runs["w4"]])
    w2 = by_step([r["records"] for r in runs["w2"]])
    chains = {
        "4 -> 2": {**first, **w2},
        "4 -> 3": {**first, **by_step([r["records"] for r in runs["w3"]])},
        "4 -> 2 -> 3": {**first, **{s: w2[s] for s in range(FIRST_SAVE + 1, SECOND_SAVE + 1)},
                        **by_step([r["records"] for r in runs["grow"]])},
    }
    for name, chain in chains.items():
        assert sorted(chain) == list(range(1, TOTAL_STEPS + 1)), name
        for epoch in range(EPOCHS):
            steps = [s for s, recs in chain.items() if recs[0]["epoch"] == epoch]
            assert steps == list(range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)), (name, epoch)
            consumed = [i for s in steps for i in global_batch(chain[s])]
            assert sorted(consumed) == list(range(N_SAMPLES)), f"{name}, epoch {epoch}: not every sample exactly once"


def test_growing_the_world_gives_new_ranks_derived_generators(runs):
    """2 -> 3 at step 11: ranks 0 and 1 continue their saved generators; rank 2
    has no past and is seeded from the derived seed (spec 2.3). Its dropout
    masks then differ from any rank of the reference, so the losses of this
    resume are not compared; the data order and the LR still are."""
    ref = reference(runs)
    got = by_step([r["records"] for r in runs["grow"]])
    assert [r["step"] for r in runs["grow"]] == [SECOND_SAVE] * 3
    assert sorted(got) == list(range(SECOND_SAVE + 1, TOTAL_STEPS + 1))
    for step, recs in got.items():
        assert global_batch(recs) == global_batch(ref[step]), f"step {step}: other samples"
        assert all((r["lr"], r["beta1"]) == (ref[step][0]["lr"], ref[step][0]["beta1"]) for r in recs), step
        for rank in (0, 1):
            w, r = ref[step][rank], recs[rank]
            assert (r["mask"], r["np"], r["py"]) == (w["mask"], w["np"], w["py"]), f"step {step} rank {rank}"
    row0 = tensorckpt.open(f"{runs['base']}/step-{SECOND_SAVE}").read("rng/torch", index=0).numpy()
    seed = derived_seed(row0, 2)  # torch.manual_seed(s), numpy.random.seed(s mod 2^32), random.seed(s)
    first = got[SECOND_SAVE + 1][2]
    mask = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) >= 0.25
    assert first["mask"] == mask.tolist()
    assert first["np"] == float(np.random.RandomState(seed % 2**32).random_sample())
    assert first["py"] == random.Random(seed).random()


# ------------------------------------------------- the training_state golden


@pytest.fixture
def golden_objects():
    """conformance/make_golden.py's ``training_objects`` (which seeds the global
    generators; they are put back afterwards) and the golden's directory."""
    root = os.path.dirname(_TESTS)
    if root not in sys.path:
        sys.path.insert(0, root)
    from conformance.make_golden import GOLDEN_V1, training_objects

    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield training_objects, GOLDEN_V1 / "training_state"
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


def test_golden_training_state_is_what_saving_the_objects_writes(golden_objects, tmp_path):
    """The goldens were written from the objects' plain state (expected.json
    describes tensors and values, not objects); saving the objects themselves
    writes the same keys, tensors and values: those of the 1.2 golden for the
    model, optimizer and scheduler (the 1.1 golden holds their 1.1 layout),
    those of the 1.1 golden for the sampler and generators. Members that torch
    defines and may change between versions (a scheduler's private ``_``
    members, an optimizer's hyperparameters, so the ids of their groups) are
    compared where both have them."""
    from conformance.make_golden import training_objects_1_2

    make, golden = golden_objects
    tensorckpt.save(make(), tmp_path / "objects")
    tensorckpt.save(training_objects_1_2(), tmp_path / "objects_1_2")
    old, new = tensorckpt.open(golden / "checkpoint"), tensorckpt.open(golden.parent / "training_state_1_2" / "checkpoint")
    got, got_1_2 = tensorckpt.open(tmp_path / "objects"), tensorckpt.open(tmp_path / "objects_1_2")

    def comparable(ck, key):
        return not key.startswith("sched/_") and not key.startswith("optim/groups/") and (
            ck is not old or not key.startswith(("model/", "optim/", "sched/")))

    def groups(ck) -> dict:  # {fqn: hyperparameters}
        out = {}
        for k in ck.keys():
            if k.startswith("optim/group_of/"):
                gid = ck.read(k)
                out[k.split("/")[2]] = {g.split("/")[3]: ck.read(g) for g in ck.keys() if g.startswith(f"optim/groups/{gid}/")}
        return out

    for want, have in ((old, got), (new, got_1_2), (new, got)):
        keys = [k for k in want.keys() if comparable(want, k) and not (have is got and k.startswith("tied/"))]
        assert keys and all(k in have.keys() for k in keys)
        for key in keys:
            a, b = have.read(key), want.read(key)
            if isinstance(b, torch.Tensor):  # training recomputed here: floats to a few ulp (see below)
                assert have.info(key).dtype == want.info(key).dtype, key
                if a.is_floating_point():
                    _close(a, b, key)
                else:
                    assert torch.equal(a, b), key
            else:
                assert a == b, key
    assert [k for k in got_1_2.keys() if comparable(new, k)] == [k for k in new.keys() if comparable(new, k)]
    mine, theirs = groups(got_1_2), groups(new)
    assert sorted(mine) == sorted(theirs) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(mine[f][m] == theirs[f][m] for f in mine for m in mine[f].keys() & theirs[f].keys())
    assert new.read("tied/head.weight/tied_to") == "embed.weight" and "tied/head.weight" not in new.keys()


def test_golden_training_state_1_2_loads_into_objects(golden_objects):
    """The 1.2 golden loads into fresh objects (an AdamW without state), its
    tied weight into a model that ties it and one that does not."""
    from conformance.make_golden import TiedLM, training_objects_1_2

    _, golden = golden_objects
    original = training_objects_1_2()
    torch.manual_seed(99)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.25)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    tied, untied = TiedLM(), TiedLM()
    untied.head.weight = nn.Parameter(torch.zeros(3, 2))
    for target in (tied, untied):
        with torch.no_grad():
            target.embed.weight.zero_()
        st = {"model": model, "optim": opt, "sched": sched, "tied": target, "step": 0}
        tensorckpt.load(st, golden.parent / "training_state_1_2" / "checkpoint")
        assert st["step"] == 2 and sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.25
        for (name, p), q in zip(model.named_parameters(), original["model"].parameters()):
            _close(p, q, name)  # ``original`` recomputes the golden's training: a few ulp
            for m in ("exp_avg", "exp_avg_sq", "step"):
                _close(opt.state[p][m], original["optim"].state[q][m], f"{name}/{m}")
        assert torch.equal(target.embed.weight, original["tied"].embed.weight)
        assert torch.equal(target.head.weight, original["tied"].embed.weight)
    assert tied.head.weight is tied.embed.weight and untied.head.weight is not untied.embed.weight


def test_golden_training_state_loads_into_objects_and_resumes_exactly(golden_objects):
    make, golden = golden_objects
    original = make()  # the run the golden was saved from, in memory
    after_save = torch.get_rng_state(), np.random.get_state(), random.getstate()

    torch.manual_seed(99)  # new objects, another init, an optimizer without state
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.25)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    sampler = tensorckpt.ResumableSampler(10, seed=0, rank=0, world=1)
    st = {"model": model, "optim": opt, "sched": sched, "data": sampler, "rng": tensorckpt.rng_state(), "step": 0}
    tensorckpt.load(st, golden / "checkpoint")

    assert st["step"] == 2 and sched.last_epoch == 2 and dict(sched.milestones) == {2: 1, 4: 1}
    assert opt.param_groups[0]["lr"] == 0.25 and opt.param_groups[0]["initial_lr"] == 0.5
    # ``original`` recomputes the golden's training steps on this machine: its
    # floats may differ from the golden's by an ulp or two (the CPU's vector
    # path), so they are compared to a few ulp; the step counts exactly.
    for (name, p), q in zip(model.named_parameters(), original["model"].parameters()):
        _close(p, q, name)
        for m in ("exp_avg", "exp_avg_sq", "step"):
            _close(opt.state[p][m], original["optim"].state[q][m], f"{name}/{m}")
    assert list(sampler) == list(original["data"]) and len(list(sampler)) == 6
    assert sampler.state_dict() == original["data"].state_dict()
    assert torch.equal(torch.get_rng_state(), after_save[0])
    assert str(np.random.get_state()) == str(after_save[1]) and random.getstate() == after_save[2]

    def step(model, opt, sched):  # one more step, drawing from the generators
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4 * (torch.rand(1, 3) > 0.25)
        (model(x) ** 2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], float(np.random.random()), random.random()

    resumed = step(model, opt, sched)
    torch.set_rng_state(after_save[0])
    np.random.set_state(after_save[1])
    random.setstate(after_save[2])
    uninterrupted = step(original["model"], original["optim"], original["sched"])
    for a, b in zip(resumed[0], uninterrupted[0]):
        _close(a, b, "resumed step")
    assert resumed[1:] == uninterrupted[1:]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-12, msg=what)
