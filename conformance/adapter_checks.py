"""The checks of the adapter conformance suite, one function per suite test.

On-disk checks read the checkpoint without the implementation under test:
the root ``zarr.json`` as JSON, every tensor through TensorStore (its own Zarr
v3 reader), the whole checkpoint through ``validate.py`` (the spec's JSON
Schemas and every storage MUST). Behavioural checks look at what the ranks saw
after the load (``adapter_run._load_job``). Each check raises AssertionError
naming the mistake, or ``NotApplicable`` (the suite test is skipped).

Imports torch, numpy, tensorstore, jsonschema (through ``validate.py``), never
tensorckpt.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import adapter_objects as ao
from .adapter_run import Case

RTOL, ATOL = 1e-4, 1e-6  # stored / loaded tensors against the reference run (sharded arithmetic reorders sums)
LOSS_RTOL = 1e-5  # the resumed run's losses against the uninterrupted run's


class NotApplicable(Exception):
    """The check does not apply to this case (e.g. no optimizer in a boxes layout)."""


@dataclass
class CaseResult:
    adapter: str
    case: Case
    path: Path
    save: list  # per rank: ("ok", dict) | ("error", traceback)
    load: list
    ref: ao.Reference

    def saved(self) -> list[dict]:
        errors = [(r, v) for r, (s, v) in enumerate(self.save) if s != "ok"]
        assert not errors, f"{self.case.name}: the save failed on rank {errors[0][0]}:\n{errors[0][1]}"
        return [v for _, v in self.save]

    def loaded(self) -> list[dict]:
        self.saved()
        errors = [(r, v) for r, (s, v) in enumerate(self.load) if s != "ok"]
        assert not errors, f"{self.case.name}: the load failed on rank {errors[0][0]}:\n{errors[0][1]}"
        return [v for _, v in self.load]


# ------------------------------------------------------------------ reading, without the implementation


def root(path: Path) -> dict:
    doc = json.loads((Path(path) / "zarr.json").read_text(encoding="utf-8"))
    return doc["attributes"]["tensorckpt"]


def read_tensor(path: Path, key: str) -> torch.Tensor:
    """The tensor at flat key ``key``, read by TensorStore alone."""
    import tensorstore as ts

    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(Path(path) / key)}},
                  open=True, read=True).result().read().result()
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr).copy())


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}"
    torch.testing.assert_close(actual.float(), expected.float(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _fqns(res: CaseResult) -> list[str]:
    return list(res.ref.params)


def _has_optimizer(layout: ao.Layout) -> bool:
    return layout.kind != "boxes"


# ------------------------------------------------------------------ on-disk checks


def check_validates(res: CaseResult) -> None:
    """The checkpoint passes validate.py: the root metadata and array documents
    against spec/schema/*.json, every storage MUST, the training-state layouts."""
    from . import validate

    res.saved()
    report = validate.validate(res.path)
    bad = [f"{v.rule} at {v.where}: {v.message}" for v in report.violations]
    assert report.exit_code == 0 and not bad, f"validate.py reports {len(bad)} violation(s): " + "; ".join(bad[:5])


def check_tensors(res: CaseResult) -> None:
    """Every model tensor, read with TensorStore alone, is the reference's full tensor."""
    res.saved()
    meta = root(res.path)
    for fqn, full in res.ref.params.items():
        key = f"model/{fqn}"
        assert key in meta["tensors"], f"{key} is not a tensor of the checkpoint (model entries at model/<fqn>, spec 3)"
        _close(read_tensor(res.path, key), full, key)


def check_dtypes(res: CaseResult) -> None:
    """Every tensor is stored with its dtype: the model's float32, extra/ema bfloat16 (no upcast)."""
    res.saved()
    meta = root(res.path)
    want = {f"model/{f}": "float32" for f in res.ref.params} | {"extra/ema": "bfloat16"}
    for key, dtype in want.items():
        entry = meta["tensors"].get(key)
        assert entry is not None, f"{key} is not stored as a tensor"
        assert entry["dtype"] == dtype, f"{key} is stored as {entry['dtype']}, the state holds {dtype}: a tensor's dtype must be kept"
        assert str(read_tensor(res.path, key).dtype) == f"torch.{dtype}", f"{key}: the Zarr array's data type is not {dtype}"


def check_extra(res: CaseResult) -> None:
    """Extra state: the bfloat16 tensor's values and the JSON values."""
    res.saved()
    meta = root(res.path)
    want = ao.extra_state(True)
    assert "extra/ema" in meta["tensors"], "extra/ema is not stored as a tensor"
    got = read_tensor(res.path, "extra/ema").to(torch.float32)
    assert torch.equal(got, want["ema"].float()), "extra/ema: stored values differ"
    for k in ("count", "tag"):
        assert meta["values"].get(f"extra/{k}") == want[k], f"extra/{k} = {meta['values'].get(f'extra/{k}')!r}, expected {want[k]!r}"


def check_moments_fqn(res: CaseResult) -> None:
    """Optimizer moments under parameter FQNs (spec 4.1, 4.2: K/state/<fqn>/<name>), equal to the reference's."""
    if not _has_optimizer(res.case.save):
        raise NotApplicable("no optimizer in a boxes layout")
    res.saved()
    meta = root(res.path)
    assert meta["values"].get("optim/class") == "AdamW", f"optim/class = {meta['values'].get('optim/class')!r}, expected 'AdamW' (spec 4.2)"
    for fqn in _fqns(res):
        for name in ("exp_avg", "exp_avg_sq"):
            key = f"optim/state/{fqn}/{name}"
            assert key in meta["tensors"], (
                f"{key} missing: optimizer state must be keyed by parameter FQN, never by integer ids (spec 4.1); "
                f"stored optim keys: {sorted(k for k in [*meta['tensors'], *meta['values']] if k.startswith('optim/'))[:6]}")
            got = read_tensor(res.path, key)
            want = res.ref.moments[fqn][name]
            if tuple(got.shape) == tuple(want.shape):
                _close(got, want, key)
        step = meta["values"].get(f"optim/state/{fqn}/step")
        assert step == float(ao.STEPS), f"optim/state/{fqn}/step = {step!r}, expected {float(ao.STEPS)} (a JSON number, spec 4.2)"


def check_moments_shape(res: CaseResult) -> None:
    """Each moment is a logical tensor of its parameter's global shape (spec 4.2 item 1), not a shard."""
    if not _has_optimizer(res.case.save):
        raise NotApplicable("no optimizer in a boxes layout")
    res.saved()
    meta = root(res.path)
    found = 0
    for fqn, p in res.ref.params.items():
        for name in ("exp_avg", "exp_avg_sq"):
            entry = meta["tensors"].get(f"optim/state/{fqn}/{name}")
            if entry is None:
                continue
            found += 1
            assert entry["shape"] == list(p.shape), (
                f"optim/state/{fqn}/{name} is stored as {entry['shape']}, its parameter is {list(p.shape)}: "
                "moments are stored at the parameter's global shape, not a rank's local shard (spec 4.2)")
    assert found, "no moment found under optim/state/<fqn>/ to check"


def check_param_groups(res: CaseResult) -> None:
    """K/group_of/<fqn> names the group whose K/groups/<id>/ holds its lr and weight decay (spec 4.2)."""
    if not _has_optimizer(res.case.save):
        raise NotApplicable("no optimizer in a boxes layout")
    res.saved()
    values = root(res.path)["values"]
    lr = res.ref.lrs[0]
    for fqn in _fqns(res):
        gid = values.get(f"optim/group_of/{fqn}")
        assert isinstance(gid, str), f"optim/group_of/{fqn} missing (every parameter has one, spec 4.2)"
        for hp, want in (("lr", lr), ("weight_decay", res.ref.weight_decay[fqn]), ("initial_lr", ao.LR)):
            got = values.get(f"optim/groups/{gid}/{hp}")
            assert got is not None and math.isclose(got, want, rel_tol=1e-12), f"optim/groups/{gid}/{hp} = {got!r}, expected {want}"


def check_scheduler(res: CaseResult) -> None:
    """The scheduler's state_dict members at sched/<name> and sched/class (spec 5)."""
    if not _has_optimizer(res.case.save):
        raise NotApplicable("no scheduler in a boxes layout")
    res.saved()
    values = root(res.path)["values"]
    assert values.get("sched/class") == "StepLR", f"sched/class = {values.get('sched/class')!r}, expected 'StepLR' (spec 5)"
    for name in ("last_epoch", "base_lrs", "_last_lr", "step_size", "gamma", "_step_count"):
        want = json.loads(json.dumps(res.ref.sched[name]))
        assert values.get(f"sched/{name}") == want, f"sched/{name} = {values.get(f'sched/{name}')!r}, expected {want!r}"


def check_sampler_state(res: CaseResult) -> None:
    """The sampler's values of rng-and-data.md 3.3, with every data-parallel rank's count."""
    saved = res.saved()
    values = root(res.path)["values"]
    dp_world = res.case.save.dp(0)[1]
    want = {"data/version": 1, "data/num_samples": ao.NUM_SAMPLES, "data/seed": ao.DATA_SEED, "data/shuffle": True,
            "data/epoch": 0, "data/world": dp_world, "data/segments": []}
    for key, v in want.items():
        assert values.get(key) == v, f"{key} = {values.get(key)!r}, expected {v!r} (rng-and-data.md 3.3)"
    for s in saved:
        key = f"data/rank/{s['dp_rank']}/consumed"
        assert values.get(key) == len(s["consumed"]), f"{key} = {values.get(key)!r}, rank consumed {len(s['consumed'])}"


def expected_rng_rows(rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s rows after the suite seeded it (rng-and-data.md 2.2 encodings)."""
    keep = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        ao.seed_all(ao.RNG_SEED + rank)
        t = torch.get_rng_state().numpy().copy()
        _, keys, pos, has_g, g = np.random.get_state()  # type: ignore[misc]
        npy = np.array([*map(int, keys), pos, has_g, _float_bits(float(g))], dtype=np.int64)
        version, internal, gauss = random.getstate()
        py = np.array([version, *internal, 0 if gauss is None else 1, 0 if gauss is None else _float_bits(gauss)], dtype=np.int64)
    finally:
        torch.set_rng_state(keep[0])
        np.random.set_state(keep[1])
        random.setstate(keep[2])
    return {"torch": t, "numpy": npy, "python": py}


def _float_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def check_rng_rows(res: CaseResult) -> None:
    """rng/torch, rng/numpy, rng/python: one row per saving rank, row r rank r's own state (rng-and-data.md 2.1)."""
    res.saved()
    meta = root(res.path)
    world = res.case.save.world
    for name in ("torch", "numpy", "python"):
        key = f"rng/{name}"
        assert key in meta["tensors"], f"{key} is not stored"
        rows = read_tensor(res.path, key).numpy()
        assert rows.shape[0] == world, f"{key} has {rows.shape[0]} rows, {world} ranks saved"
        for r in range(world):
            want = expected_rng_rows(r)[name]
            assert rows.shape[1] == want.shape[0] and np.array_equal(rows[r], want), (
                f"{key} row {r} is not rank {r}'s generator state" +
                (" (it is rank 0's: every rank's own state must be saved)" if r and np.array_equal(rows[r], rows[0]) else ""))


# ------------------------------------------------------------------ behavioural checks


def check_loss(res: CaseResult) -> None:
    """After the load at the other layout, the next steps' losses are the uninterrupted run's."""
    loaded = res.loaded()
    if "losses" not in loaded[0]:
        raise NotApplicable(f"no training step at a {res.case.load.kind} layout")
    for r, out in enumerate(loaded):
        for i, (got, want) in enumerate(zip(out["losses"], res.ref.losses)):
            assert math.isclose(got, want, rel_tol=LOSS_RTOL, abs_tol=1e-8), (
                f"rank {r}: loss of step {ao.STEPS + 1 + i} after the resume is {got!r}, the uninterrupted run's {want!r} "
                f"(tolerance {LOSS_RTOL:g} relative)")


def check_loaded_state(res: CaseResult) -> None:
    """The loaded parameters, moments, LR, scheduler epoch and extra state equal the saved ones."""
    loaded = res.loaded()
    for r, out in enumerate(loaded):
        if "boxes" in out:
            for fqn, (local, off) in out["boxes"].items():
                full = res.ref.params[fqn]
                _close(torch.from_numpy(local), full[off[0]:off[0] + local.shape[0]], f"rank {r} box of {fqn}")
        for fqn, v in out.get("params", {}).items():
            _close(torch.from_numpy(v), res.ref.params[fqn], f"rank {r} {fqn}")
            if _has_optimizer(res.case.save):
                for name, want in res.ref.moments[fqn].items():
                    got = out["moments"][fqn].get(name)
                    assert got is not None, f"rank {r}: optimizer state {fqn}/{name} was not loaded"
                    _close(torch.from_numpy(got), want, f"rank {r} {fqn}/{name}")
        if "lrs" in out and _has_optimizer(res.case.save):
            assert out["lrs"] == res.ref.lrs, f"rank {r}: lrs {out['lrs']} after the load, saved {res.ref.lrs}"
            assert out["last_epoch"] == ao.STEPS, f"rank {r}: scheduler last_epoch {out['last_epoch']}, saved {ao.STEPS}"
        extra = ao.extra_state(True)
        ema = torch.from_numpy(out["extra"]["ema"]).view(torch.bfloat16)
        assert out["extra_dtype"] == "bfloat16" and torch.equal(ema, extra["ema"]), f"rank {r}: extra/ema not restored"
        assert (out["extra"]["count"], out["extra"]["tag"]) == (extra["count"], extra["tag"]), f"rank {r}: extra values not restored"


def check_samples(res: CaseResult) -> None:
    """Every sample of the epoch is seen exactly once across the save and the load
    (another data-parallel size included); ranks of one DP replica see the same samples."""
    saved, loaded = res.saved(), res.loaded()
    seen: list[int] = []
    for phase, outs in (("before the save", saved), ("after the load", loaded)):
        by_dp: dict[int, list[int]] = {}
        for r, out in enumerate(outs):
            prev = by_dp.setdefault(out["dp_rank"], out["consumed"])
            assert prev == out["consumed"], f"{phase}: rank {r} and a peer of DP rank {out['dp_rank']} saw different samples"
        for v in by_dp.values():
            seen += v
    counts = Counter(seen)
    twice = sorted(i for i, c in counts.items() if c > 1)
    never = sorted(set(range(ao.NUM_SAMPLES)) - set(counts))
    assert not twice and not never, (
        f"DP {res.case.save.dp(0)[1]} -> {res.case.load.dp(0)[1]}: samples seen twice {twice[:8]}, never {never[:8]} "
        "(rng-and-data.md 3: every sample of the epoch exactly once)")


def derived_seed(torch_row0: bytes, rank: int) -> int:
    """rng-and-data.md 2.3 item 2."""
    digest = hashlib.sha256(b"tensorckpt/rng/v1\x00" + torch_row0 + rank.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little")


def expected_draws(seed: int) -> dict[str, Any]:
    keep = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        ao.seed_all(seed)
        return ao.draws()
    finally:
        torch.set_rng_state(keep[0])
        np.random.set_state(keep[1])
        random.setstate(keep[2])


def check_rng_streams(res: CaseResult) -> None:
    """After the load, rank r < S continues rank r's saved streams; a new rank r >= S
    follows its derived seed (rng-and-data.md 2.3)."""
    loaded = res.loaded()
    saving = res.case.save.world
    row0 = read_tensor(res.path, "rng/torch").numpy()[0].tobytes()  # T_0: row 0 as stored
    for r, out in enumerate(loaded):
        if r < saving:
            want, rule = expected_draws(ao.RNG_SEED + r), f"rank {r}'s saved state"
        else:
            want, rule = expected_draws(derived_seed(row0, r)), f"the derived seed of new rank {r}"
        assert out["draws"] == want, f"rank {r}: generators after the load do not follow {rule} (rng-and-data.md 2.3)"


CHECKS = {
    "test_checkpoint_validates": check_validates,
    "test_tensors_match_reference": check_tensors,
    "test_tensor_dtypes": check_dtypes,
    "test_extra_state": check_extra,
    "test_optimizer_moments_under_fqns": check_moments_fqn,
    "test_optimizer_moments_global_shape": check_moments_shape,
    "test_optimizer_param_groups": check_param_groups,
    "test_scheduler_state": check_scheduler,
    "test_sampler_state": check_sampler_state,
    "test_rng_rows_per_rank": check_rng_rows,
    "test_resumed_loss_matches_uninterrupted": check_loss,
    "test_loaded_state_matches_saved": check_loaded_state,
    "test_samples_seen_exactly_once": check_samples,
    "test_rng_streams_follow_spec": check_rng_streams,
}
