"""Train on 4 ranks, checkpoint, "fail", resume on 2 ranks: the run goes on as
if it had never stopped.

    python examples/train_resume.py [--dir DIR]

Everything runs on this machine's CPU: the script starts its own gloo
workers on 127.0.0.1 (torch.multiprocessing). The model is sharded with
FSDP2 (``fully_shard``), trained with AdamW and a OneCycleLR schedule on a
synthetic dataset read through ``tensorckpt.ResumableSampler``. Three runs:

    reference   4 ranks, 16 steps, uninterrupted
    interrupted 4 ranks: checkpoint at step 5, then "crash" at step 7
                (the 2 steps after the checkpoint are lost)
    resumed     2 ranks: load step 5 (each rank reads only its new shards),
                train on to step 16

One checkpoint holds the whole training state: model, optimizer (AdamW's
moments, sharded like their parameters), LR schedule, data position and
every rank's random generators:

    tensorckpt.save({"model": model, "optim": opt, "sched": sched, "data": sampler,
                     "rng": tensorckpt.rng_state(), "step": step}, path)

The global batch is 12 samples: 3 per rank on 4 ranks, 6 per rank on 2. The
script prints the losses of the reference and of the resumed run side by
side, checks the LR at every step, AdamW's moments at the end and that every
sample of each epoch was trained on exactly once, prints ``tensorckpt
inspect`` of the checkpoint, and exits non-zero if anything differs.

The runs use float64: changing the world size changes the order in which the
gradient of the global batch is summed, which float64 keeps to ~1e-15
relative (float32 would differ at ~1e-7); the tolerance below is 1e-9.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import tensorckpt

N_SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 12, 2
STEPS = EPOCHS * N_SAMPLES // GLOBAL_BATCH  # 16
SAVE_AT, CRASH_AT = 5, 7
RTOL = 1e-9


# ------------------------------------------------------------ the training


class Data(torch.utils.data.Dataset):
    """Synthetic regression data; each item carries its index."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N_SAMPLES, 8, generator=g, dtype=torch.float64)
        self.y = torch.tanh(self.x @ torch.randn(8, 2, generator=g, dtype=torch.float64))

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


def setup(world: int, seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2)).double()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
    data = Data()
    sampler = tensorckpt.ResumableSampler(data, seed=42)  # rank and world from torch.distributed
    # A generator of its own for the loader: a DataLoader draws a seed for its
    # workers from it each epoch (and at a resume); by default it would draw from
    # torch's global generator, which rng_state() checkpoints for the model's use.
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler,
                                         generator=torch.Generator().manual_seed(seed))
    return model, opt, sched, sampler, loader


def train(world: int, step: int, stop: int, model, opt, sched, sampler, loader, on_step=lambda s: None):
    """Steps step+1 .. stop; per step: (global loss, LR, the sample indices of the global batch)."""
    log = {}
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for idx, x, y in sampler.track(loader):  # counts each batch as consumed when the loop gets it
            step += 1
            lr = opt.param_groups[0]["lr"]
            per_sample = ((model(x) - y) ** 2).mean(dim=1)
            per_sample.mean().backward()  # FSDP2 averages the gradients over the ranks
            opt.step()
            sched.step()
            opt.zero_grad()
            total = per_sample.detach().sum()
            dist.all_reduce(total)
            everyone = [None] * world
            dist.all_gather_object(everyone, idx.tolist())
            log[step] = (total.item() / GLOBAL_BATCH, lr, sorted(i for ids in everyone for i in ids), epoch)
            on_step(step)
            if step == stop:
                return log
    return log


def moments(model, opt) -> dict:
    """AdamW's moments as full tensors (numpy), by parameter name."""
    return {f"{name}/{m}": opt.state[p][m].full_tensor().numpy().copy()
            for name, p in model.named_parameters() for m in ("exp_avg", "exp_avg_sq")}


def state(model, opt, sched, sampler, step):
    return {"model": model, "optim": opt, "sched": sched, "data": sampler, "rng": tensorckpt.rng_state(), "step": step}


def reference(rank, world, path):
    objs = setup(world)
    log = train(world, 0, STEPS, *objs)
    return log, moments(objs[0], objs[1])


def interrupted(rank, world, path):
    objs = setup(world)

    def on_step(step):
        if step == SAVE_AT:
            tensorckpt.save(state(*objs[:4], step), path, overwrite=True)  # --dir may hold one from before
            if rank == 0:
                print(f"  step {step}: saved {path}", flush=True)

    log = train(world, 0, CRASH_AT, *objs, on_step=on_step)
    if rank == 0:
        print(f"  step {CRASH_AT}: the job dies (steps {SAVE_AT + 1}..{CRASH_AT} are lost)", flush=True)
    return log, None


def resumed(rank, world, path):
    objs = setup(world, seed=1)  # a different init: everything comes from the checkpoint
    st = state(*objs[:4], 0)
    tensorckpt.load(st, path)
    if rank == 0:
        print(f"  loaded {path} at step {st['step']} on {world} ranks", flush=True)
    log = train(world, st["step"], STEPS, *objs)
    return log, moments(objs[0], objs[1])


# ---------------------------------------------------------------- launching


def _worker(rank, world, port, fn, args, queue):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            queue.put((rank, fn(rank, world, *args), None))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        queue.put((rank, None, traceback.format_exc()))


def launch(world: int, fn, *args):
    """Run fn(rank, world, *args) on ``world`` gloo ranks; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, value, error = queue.get(timeout=300)
            if error:
                sys.exit(f"rank {rank} of {fn.__name__} failed:\n{error}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results[0]


# --------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="tensorckpt-resume-")
    path = os.path.join(root, f"step-{SAVE_AT}")

    print(f"reference: 4 ranks, steps 1..{STEPS}, uninterrupted")
    ref, ref_moments = launch(4, reference, path)
    print("interrupted: 4 ranks from step 1")
    before, _ = launch(4, interrupted, path)
    print("resumed: 2 ranks")
    after, end_moments = launch(2, resumed, path)

    failures = []
    print("\nglobal loss per step: the reference (4 ranks throughout) and the interrupted run (4 ranks, then 2)")
    print(f"{'step':>4}  {'epoch':>5}  {'ranks':>5}  {'reference':>18}  {'interrupted':>18}  {'rel. diff':>9}  lr")
    for step in range(1, STEPS + 1):
        loss, lr, batch, epoch = ref[step]
        if step <= SAVE_AT:
            got, ranks = before[step], 4
        else:
            got, ranks = after[step], 2
        diff = abs(got[0] - loss) / abs(loss)
        mark = ""
        if diff > RTOL or got[1] != lr or got[2] != batch or got[3] != epoch:
            mark = "  <-- differs"
            failures.append(f"step {step}: " + ("other samples" if got[2] != batch else f"{got[:2]} vs {(loss, lr)}"))
        print(f"{step:>4}  {epoch:>5}  {ranks:>5}  {loss:>18.15f}  {got[0]:>18.15f}  {diff:>9.1e}  {lr:.6f}{mark}")
        if step == SAVE_AT:
            print(f"      -- checkpoint at step {SAVE_AT}; the run dies at step {CRASH_AT}, resumes here on 2 ranks --")

    worst = 0.0
    for key, want in ref_moments.items():
        err = np.abs(end_moments[key] - want) / (np.abs(want) + RTOL * np.abs(want).max())
        worst = max(worst, float(err.max()))
    print(f"\nAdamW moments at step {STEPS} (full tensors), worst relative difference: {worst:.1e}")
    if worst > RTOL:
        failures.append(f"moments differ by {worst:.1e}")

    chain = {**{s: before[s] for s in range(1, SAVE_AT + 1)}, **after}
    for epoch in range(EPOCHS):
        seen = sorted(i for s, rec in chain.items() if rec[3] == epoch for i in rec[2])
        once = seen == list(range(N_SAMPLES))
        print(f"epoch {epoch}: every one of the {N_SAMPLES} samples trained on exactly once: {once}")
        if not once:
            failures.append(f"epoch {epoch}: samples not seen exactly once")

    print()
    tensorckpt.cli.main(["inspect", path])
    if failures:
        print("\nMISMATCH:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"\nresumed on 2 ranks = uninterrupted on 4 ranks (rtol {RTOL:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
