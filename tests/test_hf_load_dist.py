"""``tensorckpt.load_safetensors``: Hugging Face weights (sharded, with an
index) straight into tiny Llamas sharded three ways, each rank reading only
its own byte ranges; values and logits equal a single-process
``from_pretrained``. One spawned launch of 4 ranks holds all three: FSDP x TP
on a 2x2 mesh (TP Colwise/Rowwise on the attention and MLP projections, then
FSDP2 on dp: ``_StridedShard`` placements), FSDP2 at world 2 (the dp
dimension) and FSDP2 at world 3 (ranks 0-2, uneven shards). The world-3 run
also trains one step and saves with torch DCP (``get_state_dict``, one
``.distcp`` file per rank), which
``tensorckpt.convert`` turns into logical arrays that the adapters load into a
plain model and optimizer. In-process: ShardedTensor column boxes (one byte
range per row), plain tensors, mismatches.
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


def _fsdp2(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _fsdp_tp(model, mesh) -> None:
    """Tensor parallelism on the "tp" mesh dimension (Colwise q/k/v and
    gate/up, Rowwise o and down), then FSDP2 on "dp": the FSDP-sharded
    Colwise weights are ``_StridedShard(0)`` over ``Shard(0)``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    _fsdp2(model, mesh["dp"])


def _load_one(model, hf_dir: str, group=None):
    stats = tensorckpt.LoadStats()
    tensorckpt.load_safetensors(model, hf_dir, stats=stats, process_group=group)
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    full = {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}
    return stats.bytes_read, stats.bytes_needed, logits.numpy(), full


def _world(rank: int, world: int, hf_dir: str, dcp_dir: str):
    """One launch of 4 ranks, three layouts: FSDP x TP on a 2x2 mesh (all
    ranks), FSDP2 at world 2 (the mesh's dp dimension: ranks {0, 2} and
    {1, 3} each hold one model), FSDP2 at world 3 (ranks 0-2, uneven shards;
    rank 3 sits it out), the last one also training a step and saving DCP."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict = {}
    # random weights, different on every rank and layout: the load must replace them all
    torch.manual_seed(100 + rank)
    model = transformers.LlamaForCausalLM(cfg)
    _fsdp_tp(model, mesh)
    placements = str(model.model.layers[0].self_attn.q_proj.weight.placements)
    out["fsdp_tp"] = _load_one(model, hf_dir)
    torch.manual_seed(200 + rank)
    model = transformers.LlamaForCausalLM(cfg)
    _fsdp2(model, mesh["dp"])
    out["fsdp2_w2"] = _load_one(model, hf_dir)
    g3 = tdist.new_group([0, 1, 2])
    if rank == 3:
        return {**{k: v[:3] for k, v in out.items()}, "placements": placements}
    mesh3 = DeviceMesh.from_group(g3, "cpu")
    torch.manual_seed(300 + rank)
    model = transformers.LlamaForCausalLM(cfg)
    _fsdp2(model, mesh3)
    out["fsdp2_w3"] = _load_one(model, hf_dir, g3)
    # a failure on one rank (rank 1 asks for a tensor the files lack) is raised on every rank
    wrong = {"lm_head.weight" if rank != 1 else "no.such.weight": torch.zeros(128, 64)}
    try:
        tensorckpt.load_safetensors(wrong, hf_dir, process_group=g3)
        out["failed"] = None
    except tensorckpt.IncompatibleStateError as e:
        out["failed"] = str(e)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Shard, distribute_tensor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir, process_group=g3)
    # a tensor-parallel column split: every rank's chunk spans all rows
    cols = distribute_tensor(torch.arange(70.0).reshape(7, 10), mesh3, [Shard(1)])
    dcp.save({"tp": {"w": cols}}, checkpoint_id=dcp_dir + "-tp", process_group=g3)
    # numpy: torch.multiprocessing would pass tensors as shared memory, gone once the worker exits
    return {**{k: v if rank == 0 or k == "failed" else v[:3] for k, v in out.items()}, "placements": placements}


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


@pytest.fixture(scope="module")
def launched(hf):
    base, _ = hf
    return dist.run(4, _world, str(base / "hf"), str(base / "dcp3"), timeout=240)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# (layout, ranks holding one model, how many times the launch holds each model)
LAYOUTS = [("fsdp2_w3", 3, 1), ("fsdp2_w2", 4, 2), ("fsdp_tp", 4, 1)]


@pytest.mark.parametrize("layout,ranks,copies", LAYOUTS)
def test_ranks_read_only_their_shards(hf, launched, layout, ranks, copies):
    _, ref = hf
    model = ref.state_dict()
    total = sum(_nbytes(v) for v in model.values())
    with torch.no_grad():
        want = ref(input_ids=_ids()).logits
    got = [launched[r][layout] for r in range(ranks)]
    for read, needed, logits in (g[:3] for g in got):
        assert read == needed  # not a byte of another rank's shard
        torch.testing.assert_close(torch.from_numpy(logits), want)
    needed = [g[1] for g in got]
    if layout == "fsdp_tp":
        # the tensor-parallel weights are cut in 4 (tp, then dp); the rest (embeddings, norms, lm_head) in 2 by dp,
        # held once per tp rank
        tp = sum(_nbytes(v) for k, v in model.items() if k.endswith("proj.weight"))
        assert sum(needed) == tp + 2 * (total - tp)
        assert max(needed) < total // 2
    else:
        assert sum(needed) == copies * total  # the shards partition the model (once per dp group)
    print(f"{layout}: bytes read per rank {[g[0] for g in got]} (needed {needed}, model {total})")
    for k, v in model.items():
        assert torch.equal(torch.from_numpy(got[0][3][k]), v), (layout, k)


def test_fsdp_tp_weights_are_strided(launched):
    """The FSDP x TP layout is the one FSDP2 builds over tensor parallelism:
    a Colwise weight is ``_StridedShard(0)`` on dp over ``Shard(0)`` on tp."""
    for r in range(4):
        assert "_StridedShard(dim=0" in launched[r]["placements"] and "Shard(dim=0)" in launched[r]["placements"]


def test_errors_and_dcp_of_the_world3_run(hf, launched, monkeypatch):
    base, _ = hf
    out = [launched[r] for r in range(3)]
    assert all("no.such.weight" in o["failed"] for o in out)
    assert all("failed on rank 1 of 3: IncompatibleStateError:" in o["failed"] for o in out)  # every rank names it
    dcp_dir = str(base / "dcp3")
    # column chunks, read in slabs of 2 rows (stored objects of 80 bytes): each chunk is loaded once
    from tensorckpt.interchange.dcp import DCPSource

    loads, load = [], DCPSource._load
    monkeypatch.setattr(DCPSource, "_load", lambda self, fqn, offsets, *a: loads.append((fqn, offsets)) or load(self, fqn, offsets, *a))
    tensorckpt.convert(dcp_dir + "-tp", base / "tp3", memory_bytes=100, shard_bytes=80, progress=False)
    assert sorted(loads) == sorted({(f, o) for f, o in loads}) and len(loads) == 3  # 4 slabs, each chunk read once
    assert torch.equal(tensorckpt.open(base / "tp3").read("tp/w"), torch.arange(70.0).reshape(7, 10))
    # the run's DCP checkpoint (one .distcp file per rank) -> tensorckpt -> a plain model and optimizer
    assert len([n for n in os.listdir(dcp_dir) if n.endswith(".distcp")]) == 3
    tensorckpt.convert(dcp_dir, base / "from-dcp3", progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(base / "hf")  # a copy: the fixture's stays untrained
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ids = _ids()
    ref(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    torch.manual_seed(5)
    plain = transformers.LlamaForCausalLM(ref.config)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    tensorckpt.load({"model": plain, "optim": plain_opt}, base / "from-dcp3")
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
