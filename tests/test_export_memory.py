"""Export from a checkpoint saved by several ranks stays within its memory
bound: 96 MiB of tensors saved at world 2 (a 64 MiB tensor cut by rows, one
box per rank; a 32 MiB tensor cut by columns, so that every row slab spans
both ranks' boxes) exported to safetensors and to DCP with
``memory_bytes=8 MiB`` in a fresh process grows its peak RSS by less
than either tensor (the bound plus the reader's and writer's buffers: no
tensor is gathered whole). ``torch.save`` is one pickle of the whole
selected state, so that export holds all of it: its growth is at least the
state and at most the state plus the same overhead. About 15 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist
import rss

import tensorckpt

MiB = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"rows": torch.randn(4096, 4096, generator=g), "cols": torch.randn(2048, 4096, generator=g)}


def _save(rank: int, world: int, path: str) -> None:
    sd = _state()
    r, c = 4096 // world, 4096 // world
    state = {"rows": tensorckpt.ShardedTensor(sd["rows"][rank * r:(rank + 1) * r].clone(), (4096, 4096), (rank * r, 0)),
             "cols": tensorckpt.ShardedTensor(sd["cols"][:, rank * c:(rank + 1) * c].clone(), (2048, 4096), (0, rank * c))}
    del sd
    tensorckpt.save(state, path, shard_bytes=4 * MiB)


_MEASURE = rss.PEAK + r"""
import json, sys, warnings
import torch, tensorckpt
from safetensors.torch import save_file
tmp = sys.argv[1]
save_file({"w": torch.ones(64, 64)}, f"{tmp}/warm.safetensors")  # one-time costs first (threads, arenas, caches)
tensorckpt.convert(f"{tmp}/warm.safetensors", f"{tmp}/warm-ck", progress=False)
for fmt, dst in (("safetensors", "warm-st"), ("dcp", "warm-dcp")):
    tensorckpt.convert(f"{tmp}/warm-ck", f"{tmp}/{dst}", progress=False, to_format=fmt)
growth = {}
for fmt, dst in (("safetensors", "out-st"), ("dcp", "out-dcp"), ("torch", "out.pt")):
    reset_peak()
    base = status("VmRSS")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensorckpt.convert(f"{tmp}/ck", f"{tmp}/{dst}", progress=False, memory_bytes=8 << 20, to_format=fmt)
    growth[fmt] = status("VmHWM") - base
print(json.dumps(growth))
"""


def test_export_of_a_two_rank_checkpoint_stays_bounded(tmp_path):
    dist.run(2, _save, str(tmp_path / "ck"), timeout=180)
    assert len(tensorckpt.open(tmp_path / "ck").index.tensors) == 2
    # a fixed glibc mmap threshold: the measure is the data held, not the slabs glibc keeps in its heap
    # (test_convert.test_import_and_export_memory_stays_bounded says what the dynamic threshold does)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(_TESTS), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=240, check=False)
    assert out.returncode == 0, out.stderr
    growth = json.loads(out.stdout.strip().splitlines()[-1])
    print("peak RSS growth exporting 96 MiB (8 MiB bound): " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in growth.items()))
    for fmt in ("safetensors", "dcp"):
        # less than either tensor (64 and 32 MiB): neither is ever held whole (measured: 11 and 12-14 MiB)
        assert growth[fmt] < 28 * MiB, (fmt, growth[fmt] / MiB)
    # the whole selected state, once (measured 85-97 MiB: memory freed by the exports before is reused)
    assert 64 * MiB < growth["torch"] < (96 + 40) * MiB
    # the exports hold the saved values
    from safetensors.torch import load_file

    sd = _state()
    back = load_file(str(tmp_path / "out-st" / "model.safetensors"))
    pt = torch.load(tmp_path / "out.pt", weights_only=True)
    import torch.distributed.checkpoint as dcp

    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(target, checkpoint_id=str(tmp_path / "out-dcp"))
    for k, v in sd.items():
        assert torch.equal(back[k], v) and torch.equal(pt[k], v) and torch.equal(target[k], v), k
