"""End to end: a tiny random ``transformers`` Llama trained with FSDP2 x TP
on a 2x2 (dp, tp) mesh with AdamW, saved with tensorckpt after 3 steps, then
resumed (a) in one process, (b) with FSDP2 on 2 ranks, (c) with tensor
parallelism on 4 ranks; the two steps after resuming give the losses of the
uninterrupted run.

(c) shards the MLP projections 4 ways (Colwise gate/up, Rowwise down) and
keeps attention whole: the model's 2 key/value heads cannot split 4 ways.
The same pipeline runs from an FSDP2-only (1-D, 4 ranks) save, which
tensorckpt supports today, so the harness is checked even while FSDP2 x TP
saves are not (issue 11 item 1).

Tolerance: losses agree to 2e-5 relative. Every layout computes the same
float32 math with other reduction orders (TP splits matmuls, FSDP averages
gradients across ranks); measured differences are ~1e-6.
"""

from __future__ import annotations

import numpy as np
import torch
from _suite import mesh, path, scenario

import tensorckpt

STEPS, MORE, BATCH, SEQ = 3, 2, 4, 16
RTOL = 2e-5


def build(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 128, (BATCH, SEQ), generator=g)


ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj")


def tp_plan(model, attention: bool) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        for name in MLP + (ATTN if attention else ()):
            plan[p + name] = ColwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
        if attention:
            plan[p + "self_attn.o_proj"] = RowwiseParallel()
    return plan


def layout(kind: str, world: int, seed: int = 0):
    """(model, dp group, dp rank, dp size) for a layout: "fsdp_tp" (2x2), "fsdp" (1-D), "tp" (MLP TP over
    every rank), "plain"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = build(seed)
    if kind == "plain":
        return model, None, 0, 1
    if kind == "tp":
        parallelize_module(model, mesh((world,)), tp_plan(model, attention=False))
        return model, None, 0, 1
    if kind == "fsdp_tp":
        m = mesh((2, world // 2), ("dp", "tp"))
        parallelize_module(model, m["tp"], tp_plan(model, attention=True))
        dp = m["dp"]
    else:
        dp = mesh((world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, dp.get_group(), dp.get_local_rank(), dp.size()


def steps(model, opt, group, dp_rank: int, dp_size: int, which) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in which:
        ids = batch(step)
        n = BATCH // dp_size
        ids = ids[dp_rank * n:(dp_rank + 1) * n]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if group is not None:
            dist.all_reduce(value, group=group)
            value /= dp_size
        losses.append(value.item())
    return losses


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def resume(kind: str, world: int, base: str, source: str) -> list[float]:
    model, group, dp_rank, dp_size = layout(kind, world, seed=1)
    opt = optimizer(model)
    state = {"model": model, "optim": opt, "step": 0}
    tensorckpt.load(state, path(base, f"llama_{source}"))
    assert state["step"] == STEPS
    return steps(model, opt, group, dp_rank, dp_size, range(STEPS, STEPS + MORE))


SOURCES = ("fsdp_tp", "fsdp")


@scenario("w4")
def llama_train_w4(rank: int, world: int, base: str):
    out = {}
    for source in SOURCES:
        model, group, dp_rank, dp_size = layout(source, world)
        opt = optimizer(model)
        first = steps(model, opt, group, dp_rank, dp_size, range(STEPS))
        try:
            tensorckpt.save({"model": model, "optim": opt, "step": STEPS}, path(base, f"llama_{source}"))
            saved = None
        except tensorckpt.TensorckptError as e:
            saved = (type(e).__name__, str(e))
        out[source] = {"first": first, "saved": saved,
                       "reference": steps(model, opt, group, dp_rank, dp_size, range(STEPS, STEPS + MORE))}
    return out


def _resume_all(kind: str, world: int, base: str) -> dict:
    out = {}
    for source in SOURCES:
        try:
            out[source] = resume(kind, world, base, source)
        except tensorckpt.TensorckptError as e:
            out[source] = (type(e).__name__, str(e))
    return out


@scenario("w4")
def llama_resume_tp_w4(rank: int, world: int, base: str):
    return _resume_all("tp", world, base)


@scenario("w2")
def llama_resume_fsdp_w2(rank: int, world: int, base: str):
    return _resume_all("fsdp", world, base)


@scenario("w1_load")
def llama_resume_plain_w1(rank: int, world: int, base: str):
    model, _, _, _ = layout("plain", 1)
    opt = optimizer(model)
    uninterrupted = steps(model, opt, None, 0, 1, range(STEPS + MORE))
    return {"uninterrupted": uninterrupted, **_resume_all("plain", 1, base)}


def _check(peer, source: str) -> None:
    train = peer.all("w4", "llama_train_w4")
    for r in train:
        if r[source]["saved"] is not None:
            cls, msg = r[source]["saved"]
            raise getattr(tensorckpt, cls, tensorckpt.TensorckptError)(msg)
    reference = train[0][source]["reference"]
    one = peer.get("w1_load", "llama_resume_plain_w1")
    # the distributed training itself matches one process (the reference is sound)
    np.testing.assert_allclose(train[0][source]["first"] + reference, one["uninterrupted"], rtol=RTOL)
    resumed = {"one process": [one[source]],
               "FSDP2 on 2 ranks": [r[source] for r in peer.all("w2", "llama_resume_fsdp_w2")],
               "TP on 4 ranks": [r[source] for r in peer.all("w4", "llama_resume_tp_w4")]}
    for where, per_rank in resumed.items():
        for losses in per_rank:
            if isinstance(losses, tuple):
                raise getattr(tensorckpt, losses[0], tensorckpt.TensorckptError)(f"{where}: {losses[1]}")
            np.testing.assert_allclose(losses, reference, rtol=RTOL, err_msg=where)


def test_llama_fsdp2_x_tp_resumes_in_other_layouts(peer):
    """End to end (issue 11; after e2e/test_e2e_save_and_load.py::TestE2ESaveAndLoad::test_e2e with its
    disabled FSDP_TP model type): tiny Llama, FSDP2 x TP on a 2x2 mesh, AdamW, saved at step 3; resumed in
    one process, FSDP2 on 2 ranks and TP on 4 ranks, the next 2 losses equal the uninterrupted run's (2e-5 relative)."""
    _check(peer, "fsdp_tp")


def test_llama_fsdp2_resumes_in_other_layouts(peer):
    """The same pipeline from an FSDP2-only save on 4 ranks: resumed in one process, FSDP2 on 2 ranks and
    TP on 4 ranks, the next 2 losses equal the uninterrupted run's (2e-5 relative)."""
    _check(peer, "fsdp")
