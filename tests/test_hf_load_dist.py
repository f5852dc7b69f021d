"""``tensorckpt.load_safetensors``: Hugging Face weights (sharded, with an
index) straight into FSDP2-sharded tiny Llamas at worlds 2 and 3, each rank
reading only its own byte ranges; values and logits equal a single-process
``from_pretrained``. Each run also trains one step and saves with torch
DCP (``get_state_dict``, one ``.distcp`` file per rank), which
``tensorckpt.convert`` turns into logical arrays that the adapters load into a
plain model and optimizer. In-process: ShardedTensor column boxes (one byte
range per row), plain tensors, mismatches. About 30 s (one spawned world of 3;
``TENSORCKPT_HF_WORLDS=2,3`` adds world 2).
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist

import tensorckpt

transformers = pytest.importorskip("transformers")


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))


def _world(rank: int, world: int, hf_dir: str, dcp_dir: str | None):
    from torch.distributed.fsdp import fully_shard

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    torch.manual_seed(100 + rank)  # random weights, different on every rank: the load must replace them all
    model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    stats = tensorckpt.LoadStats()
    tensorckpt.load_safetensors(model, hf_dir, stats=stats)
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    # a failure on one rank (rank 1 asks for a tensor the files lack) is raised on every rank
    wrong = {"lm_head.weight" if rank != 1 else "no.such.weight": torch.zeros(128, 64)}
    try:
        tensorckpt.load_safetensors(wrong, hf_dir)
        failed = None
    except tensorckpt.IncompatibleStateError as e:
        failed = str(e)
    if dcp_dir is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = _ids()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        # a tensor-parallel column split: every rank's chunk spans all rows
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        cols = distribute_tensor(torch.arange(70.0).reshape(7, 10), mesh, [Shard(1)])
        dcp.save({"tp": {"w": cols}}, checkpoint_id=dcp_dir + "-tp")
    # numpy: torch.multiprocessing would pass tensors as shared memory, gone once the worker exits
    return (stats.bytes_read, stats.bytes_needed, logits.numpy(), {k: v.numpy() for k, v in full.items()} if rank == 0 else None,
            failed)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(base / "hf", max_shard_size="100KB")
    assert (base / "hf" / "model.safetensors.index.json").exists()
    ref = transformers.AutoModelForCausalLM.from_pretrained(base / "hf").eval()
    return base, ref


# world 3 (uneven shards: 22/22/20 rows of 64) by default; TENSORCKPT_HF_WORLDS=2,3 runs world 2 too (+30 s)
WORLDS = [int(w) for w in os.environ.get("TENSORCKPT_HF_WORLDS", "3").split(",")]


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_ranks_read_only_their_shards(hf, world, monkeypatch):
    base, ref = hf
    dcp_dir = str(base / f"dcp{world}")
    out = dist.run(world, _world, str(base / "hf"), dcp_dir, timeout=180)
    total = sum(v.numel() * v.element_size() for v in ref.state_dict().values())
    with torch.no_grad():
        want = ref(input_ids=_ids()).logits
    assert all("no.such.weight" in failed for *_, failed in out)
    assert all(failed.startswith("(on rank 1)") for rank, (*_, failed) in enumerate(out) if rank != 1)
    for rank, (read, needed, logits, *_) in enumerate(out):
        assert read == needed  # not a byte of another rank's shard
        torch.testing.assert_close(torch.from_numpy(logits), want)
    assert sum(n for _, n, *_ in out) == total  # the shards partition the model
    print(f"world {world}: bytes read per rank {[r for r, *_ in out]} (needed {[n for _, n, *_ in out]}, model {total})")
    for k, v in ref.state_dict().items():
        assert torch.equal(torch.from_numpy(out[0][3][k]), v), k
    # column chunks, read in slabs of 2 rows (stored objects of 80 bytes): each chunk is loaded once
    from tensorckpt.interchange.dcp import DCPSource

    loads, load = [], DCPSource._load
    monkeypatch.setattr(DCPSource, "_load", lambda self, fqn, offsets, *a: loads.append((fqn, offsets)) or load(self, fqn, offsets, *a))
    tensorckpt.convert(dcp_dir + "-tp", base / f"tp{world}", memory_bytes=100, shard_bytes=80, progress=False)
    assert sorted(loads) == sorted({(f, o) for f, o in loads}) and len(loads) == world  # 4 slabs, each chunk read once
    assert torch.equal(tensorckpt.open(base / f"tp{world}").read("tp/w"), torch.arange(70.0).reshape(7, 10))
    # the run's DCP checkpoint (one .distcp file per rank) -> tensorckpt -> a plain model and optimizer
    assert len([n for n in os.listdir(dcp_dir) if n.endswith(".distcp")]) == world
    tensorckpt.convert(dcp_dir, base / f"from-dcp{world}", progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(base / "hf")  # a copy: the fixture's stays untrained
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ids = _ids()
    ref(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    torch.manual_seed(5)
    plain = transformers.LlamaForCausalLM(ref.config)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    tensorckpt.load({"model": plain, "optim": plain_opt}, base / f"from-dcp{world}")
    for (n, a), (_, b) in zip(ref.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(b, a, msg=n)
        torch.testing.assert_close(plain_opt.state[b]["exp_avg"], opt.state[a]["exp_avg"], msg=n)


def test_sharded_tensor_boxes_and_plain_tensors_in_process(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(12, 10)
    b = torch.randn(10, dtype=torch.bfloat16)
    save_file({"w": w, "b": b, "unused": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    cols = tensorckpt.ShardedTensor(torch.zeros(5, 4), (12, 10), (3, 6))  # rows 3..8, columns 6..10
    state = {"net": {"w": cols, "b": torch.zeros(10)}}
    stats = tensorckpt.LoadStats()
    tensorckpt.load_safetensors(state, tmp_path / "m.safetensors", rename=lambda k: k.removeprefix("net/"),
                                cast=True, stats=stats)
    assert torch.equal(cols.local, w[3:8, 6:10])
    assert torch.equal(state["net"]["b"], b.float())
    assert stats.bytes_read == stats.bytes_needed == 5 * 4 * 4 + 10 * 2
    with pytest.raises(tensorckpt.IncompatibleStateError, match="cast=True"):
        tensorckpt.load_safetensors({"b": torch.zeros(10)}, tmp_path / "m.safetensors")
    with pytest.raises(tensorckpt.IncompatibleStateError, match=r"'w'.*\[12, 10\]"):
        tensorckpt.load_safetensors({"w": torch.zeros(10, 12)}, tmp_path / "m.safetensors")
    with pytest.raises(tensorckpt.IncompatibleStateError, match="'nope'"):
        tensorckpt.load_safetensors({"nope": torch.zeros(1)}, tmp_path / "m.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensorckpt.load_safetensors({"nope": torch.zeros(1)}, tmp_path / "m.safetensors", strict=False)


def test_modules_inside_a_state_dict(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = torch.nn.Linear(4, 3)
    save_file(src.state_dict(), str(tmp_path / "m.safetensors"))
    dst = torch.nn.Linear(4, 3)
    tensorckpt.load_safetensors({"model": dst, "step": 3}, tmp_path / "m.safetensors",
                                rename=lambda k: k.removeprefix("model/"))
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)


def test_boxes_of_3d_tensors_read_exactly_their_bytes(tmp_path):
    from safetensors.torch import save_file

    x = torch.arange(5 * 6 * 7, dtype=torch.int16).reshape(5, 6, 7)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    boxes = [((0, 0, 0), (5, 6, 7)), ((1, 0, 0), (2, 6, 7)), ((0, 2, 0), (5, 3, 7)), ((1, 2, 3), (3, 4, 2)),
             ((4, 5, 6), (1, 1, 1)), ((0, 0, 6), (5, 6, 1)), ((2, 0, 0), (0, 6, 7))]
    for offset, shape in boxes:
        box = tensorckpt.ShardedTensor(torch.full(shape, -1, dtype=torch.int16), (5, 6, 7), offset)
        stats = tensorckpt.LoadStats()
        tensorckpt.load_safetensors({"x": box}, tmp_path / "x.safetensors", stats=stats)
        want = x[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        assert torch.equal(box.local, want), (offset, shape)
        assert stats.bytes_read == stats.bytes_needed == want.numel() * 2
