"""Write the golden v1 checkpoints under conformance/golden/v1/<name>/.

    python conformance/make_golden.py            # writes the goldens that do not exist yet
    python conformance/make_golden.py --force    # rewrites all of them (never needed for v1)

Each golden is ``<name>/checkpoint/`` (a checkpoint as tensorckpt writes it)
and ``<name>/expected.json`` (what any conforming reader must get from it; the
format is described in README.md). The content is deterministic (arange-based
and fixed bit patterns); only the checkpoint's ``created`` time and
``library_version`` depend on when and by which version they were written.

Goldens are committed and must keep being readable by every later version:
once committed, do not regenerate them; add a new golden (or a new
``golden/v<N>/`` directory for a new major format version) instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

import tensorckpt
from tensorckpt.format.keys import flat_key

HERE = Path(__file__).resolve().parent
GOLDEN_V1 = HERE / "golden" / "v1"

BITS_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(values, dtype, uint):
    return torch.from_numpy(np.array(values, dtype=uint).view(np.dtype(uint).str.replace("u", "i"))).view(dtype)


def golden_basic():
    state = {
        "weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.25 - 1.0,
        "ids": torch.arange(5, dtype=torch.int64) * 1000003 - 2**40,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
        "model": {
            "encoder": {
                "layer0": {
                    "weight": torch.arange(6, dtype=torch.float16).reshape(2, 3) / 4,
                    "bias": torch.arange(3, dtype=torch.float32) - 1,
                },
            },
            "name": "basic",
        },
        "step": 42,
        "cfg": {"lr": 0.5, "betas": [0.9, 0.999], "flags": [True, False, None], "empty": {}, "tag": "é"},
    }
    return state, {}, {"golden": "basic", "purpose": "tensorckpt conformance"}


def golden_dtypes():
    f = [0.0, -0.0, 1.0, -1.5, 0.25, 3.0, -7.0, 0.125]
    state = {
        "float64": torch.tensor(f + [2.0**-1074, 1.7976931348623157e308], dtype=torch.float64),
        "float32": torch.tensor(f + [2.0**-149, 3.4028234663852886e38], dtype=torch.float32),
        "float16": torch.tensor(f + [2.0**-24, 65504.0], dtype=torch.float16),
        # bit patterns: 0, 1.0, -1.0, +inf, -inf, NaN, NaN with payload, smallest subnormal
        "bfloat16": _bits([0x0000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0x0001], torch.bfloat16, np.uint16),
        # 0, 1.0, -1.0, 448 (max), NaN, -NaN, smallest subnormal, -0
        "float8_e4m3fn": _bits([0x00, 0x38, 0xB8, 0x7E, 0x7F, 0xFF, 0x01, 0x80], torch.float8_e4m3fn, np.uint8),
        # 0, 1.0, -1.0, +inf, -inf, NaN, NaN, smallest subnormal
        "float8_e5m2": _bits([0x00, 0x3C, 0xBC, 0x7C, 0xFC, 0x7E, 0x7F, 0x01], torch.float8_e5m2, np.uint8),
        "int8": torch.cat([torch.arange(-3, 3, dtype=torch.int8), torch.tensor([-128, 127], dtype=torch.int8)]),
        "int16": torch.cat([torch.arange(-3, 3, dtype=torch.int16) * 1000, torch.tensor([-(2**15), 2**15 - 1], dtype=torch.int16)]),
        "int32": torch.cat([torch.arange(-3, 3, dtype=torch.int32) * 100003, torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32)]),
        "int64": torch.cat([torch.arange(-3, 3, dtype=torch.int64) * 1000000007, torch.tensor([-(2**63), 2**63 - 1])]),
        "uint8": torch.cat([torch.arange(0, 6, dtype=torch.uint8) * 40, torch.tensor([0x7F, 0xFF], dtype=torch.uint8)]),
        "bool": torch.arange(8) % 3 == 0,
        "complex64": torch.complex(torch.arange(4.0) - 1, torch.arange(4.0) * -0.5),
        "complex128": torch.complex(torch.arange(4.0, dtype=torch.float64) * 0.25, torch.arange(4.0, dtype=torch.float64) + 1),
        "matrix": {"int16": (torch.arange(12, dtype=torch.int16) - 6).reshape(3, 4)},
        "scalar": {"bfloat16": _bits([0x4049], torch.bfloat16, np.uint16).reshape(())},
    }
    return state, {}, {"golden": "dtypes"}


def golden_escaped_keys():
    state = {
        "": torch.arange(3, dtype=torch.int32),
        "..": {"__x": torch.arange(4, dtype=torch.float32) / 2, ".": 1},
        "a/b": {"50%": torch.arange(2, dtype=torch.int64), "": "empty-key value"},
        "__x": "dunder value",
        "_x": torch.tensor([True, False]),
        "50%": {"%2F": torch.arange(2, dtype=torch.uint8), "...": None},
        "é🙂": 2.5,
    }
    return state, {}, {"golden": "escaped_keys"}


def golden_sharded():
    # many shards and inner chunks (small shard_bytes / inner_chunk_bytes)
    state = {
        "rows": torch.arange(64, dtype=torch.float32).reshape(16, 4),
        "cube": (torch.arange(60, dtype=torch.int16) - 30).reshape(5, 3, 4),
        "vec": torch.arange(30, dtype=torch.float64) * 0.5,
    }
    return state, {"shard_bytes": 64, "inner_chunk_bytes": 32}, {"golden": "sharded"}


def golden_save_stats_1_1():
    """Format 1.1: the root metadata carries ``save_stats`` (spec 9.7)."""
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 11}
    return state, {}, {"golden": "save_stats_1_1"}


def training_objects() -> dict:
    """The training state of a tiny 1-process run, as objects: a model, AdamW
    after 2 steps (moments, steps, param groups), a MultiStepLR (its
    ``milestones`` Counter is stored as [key, value] pairs), a
    ResumableSampler 4 samples into epoch 0, and the random generators.
    Everything is arange-based or seeded, so the content is deterministic.
    tests/test_resume_e2e.py checks that saving these objects writes exactly
    the golden, and that the golden loads back into such objects."""
    import random

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_((torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) - 2) * 0.25 + i * 0.125)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.25)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    x = torch.arange(30, dtype=torch.float32).reshape(10, 3) / 8 - 1
    y = torch.arange(20, dtype=torch.float32).reshape(10, 2) / 4
    sampler = tensorckpt.ResumableSampler(10, seed=3, rank=0, world=1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=2, sampler=sampler, generator=torch.Generator()
    )
    batches = sampler.track(loader)
    for _ in range(2):
        xb, yb = next(batches)
        xb = xb * (torch.rand(1, 3) > 0.25)  # the loop draws from the generators it saves
        np.random.random(), random.random()
        ((model(xb) - yb) ** 2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"model": model, "optim": opt, "sched": sched, "data": sampler, "rng": tensorckpt.rng_state(), "step": 2}


def plain_training_state(objects: dict) -> dict:
    """What tensorckpt's adapters store for ``objects`` in a 1-process save,
    as plain tensors and JSON values (expected.json cannot describe objects)."""
    from tensorckpt.adapters import registry
    from tensorckpt.adapters.sharded import ShardedTensor

    def unwrap(node):
        if isinstance(node, dict):
            return {k: unwrap(v) for k, v in node.items()}
        if isinstance(node, ShardedTensor):  # rng rows: at world 1 the box is the whole [1, n] tensor
            assert node.global_offset == (0,) * node.local.dim() and tuple(node.local.shape) == node.global_shape
            return node.local
        return node

    return unwrap(registry.for_save(objects, registry.Context(objects, 0, 1)))


def golden_training_state():
    """Format 1.1 (written by tensorckpt before 1.2; not rewritable now: the
    adapters write 1.2): the keys of training-state.md and rng-and-data.md (model,
    optimizer, scheduler, sampler, rng) for a 1-process run (see
    :func:`training_objects`)."""
    return plain_training_state(training_objects()), {}, {"golden": "training_state"}


class TiedLM(torch.nn.Module):
    """An embedding and an output projection sharing one weight (stored once)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(3, 2)
        self.head = torch.nn.Linear(2, 3, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            self.embed.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(3, 2) * 0.5 - 1)


def training_objects_1_2() -> dict:
    """The model, AdamW and MultiStepLR of :func:`training_objects`, and a
    :class:`TiedLM` (no sampler and generators: their keys did not change)."""
    objects = training_objects()
    return {"model": objects["model"], "optim": objects["optim"], "sched": objects["sched"], "tied": TiedLM(),
            "step": objects["step"]}


def golden_training_state_1_2():
    """Format 1.2: the training-state layout of 1.2 (optimizer ``class``,
    ``group_of/<fqn>``, ``groups/<id>/<hparam>``; scheduler ``class``; a tied
    weight as ``<fqn>/tied_to``) for :func:`training_objects_1_2`."""
    return plain_training_state(training_objects_1_2()), {}, {"golden": "training_state_1_2"}


def golden_integrity_1_3():
    """Format 1.3: position-bound integrity (spec 7.1, 9.8): the root's
    ``checkpoint_id``, ``array_digests`` and ``checksum``, each array's
    ``chunk_digests``; two tensors of one shape in several chunks of several
    inner chunks, and the values a flipped bit must not change silently."""
    state = {
        "a": torch.arange(32, dtype=torch.float32).reshape(8, 4),
        "b": torch.arange(32, dtype=torch.float32).reshape(8, 4) * -0.5,
        "optim": {"lr": 0.001, "step": 1234},
        "sampler": {"epoch": 2, "position": 98765},
    }
    return state, {"shard_bytes": 64, "inner_chunk_bytes": 32}, {"golden": "integrity_1_3"}


GOLDENS = {
    "basic": golden_basic,
    "dtypes": golden_dtypes,
    "escaped_keys": golden_escaped_keys,
    "sharded": golden_sharded,
    "save_stats_1_1": golden_save_stats_1_1,
    "training_state": golden_training_state,
    "training_state_1_2": golden_training_state_1_2,
    "integrity_1_3": golden_integrity_1_3,
    "training_state_w2": None,  # saved by 2 gloo ranks: written by golden_w2.write
}


def _leaves(state, prefix=()):
    for k, v in state.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def tensor_expected(t: torch.Tensor) -> dict:
    name = str(t.dtype).removeprefix("torch.")
    flat = t.detach().contiguous().reshape(-1)
    if t.dtype in BITS_DTYPES:
        size = t.element_size()
        raw = flat.view(torch.uint8 if size == 1 else torch.int16).numpy().view(f"<u{size}")
        return {"dtype": name, "shape": list(t.shape), "encoding": "bits", "data": [int(x) for x in raw]}
    if t.is_complex():
        data = [[float(z.real), float(z.imag)] for z in flat.tolist()]
    else:
        data = flat.tolist()
    return {"dtype": name, "shape": list(t.shape), "encoding": "values", "data": data}


def expected_for(state, user_metadata, ckpt: tensorckpt.Checkpoint) -> dict:
    tensors, values = {}, {}
    for path, v in _leaves(state):
        key = flat_key(path)
        if isinstance(v, torch.Tensor):
            info = ckpt.info(key)
            tensors[key] = {"path": list(path), **tensor_expected(v),
                            "chunk_shape": list(info.chunk_shape), "inner_chunk_shape": list(info.inner_chunk_shape)}
        else:
            values[key] = {"path": list(path), "value": json.loads(json.dumps(v))}  # tuples -> lists
    return {
        "format_version": ckpt.metadata.format_version,
        "checkpoint": "checkpoint",
        "user_metadata": user_metadata,
        "keys": sorted([*tensors, *values]),
        "tensors": tensors,
        "values": values,
    }


def write_golden(name: str, force: bool) -> bool:
    out = GOLDEN_V1 / name
    if out.exists():
        if not force:
            return False
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if GOLDENS[name] is None:
        from conformance import golden_w2

        golden_w2.write(out)
        return True
    state, options, user = GOLDENS[name]()
    tensorckpt.save(state, out / "checkpoint", metadata=user, **options)
    expected = expected_for(state, user, tensorckpt.open(out / "checkpoint"))
    (out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                                       encoding="utf-8")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rewrite existing goldens (breaks their history)")
    ap.add_argument("names", nargs="*", default=list(GOLDENS), help=f"goldens to write (default: all: {list(GOLDENS)})")
    args = ap.parse_args(argv)
    for name in args.names:
        wrote = write_golden(name, args.force)
        print(f"{'wrote' if wrote else 'kept '} {GOLDEN_V1 / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
