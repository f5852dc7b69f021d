"""A fork server of checkpoint writers for the fault-injection tests
(tests/test_faults.py): run as ``python tests/fault_writer.py``.

It imports torch and tensorckpt once, prints ``ready``, then reads one JSON
command per line on stdin and answers one JSON line on stdout. For a command
it forks ``world`` writer processes (fresh ones each time, so no state is
shared between trials); each writes ``go`` on its pipe just before it starts
its save and ``done SECONDS`` once the save returned. When every writer said
``go``, the server waits ``delay`` seconds and kills the ``victims`` with
SIGKILL (no delay: nobody is killed), then waits for the others up to
``timeout`` seconds (ranks of a distributed save fail or hang once a peer is
dead) and kills whatever is left. With ``kill_at_op`` K instead, each victim
kills itself (SIGKILL) just before its K-th storage operation (see ``_arm``):
the short windows of the commit are hit as often as the long ones. The forked writers start in milliseconds,
so many trials fit in a short test.

Command: {"kind": K, "root": DIR, "step": N, "delay": S | null, "kill_at_op":
K | null, "victims": [ranks], "world": W, "timeout": S}. Kinds:

    mgr-sync, mgr-async     CheckpointManager(root, keep_last=2,
                            reader_grace=0).save / .async_save(...).wait()
                            of step N (its retention runs after the commit)
    replace-sync, replace-async
                            tensorckpt.save / async_save(..., overwrite=True)
                            of version N onto ROOT/ckpt
    replace-fallback        replace-sync where renameat2(RENAME_EXCHANGE) is
                            unavailable (spec 10.2 step 4, the two renames)
    dist-sync, dist-async   W gloo ranks, a CheckpointManager save of step N
                            (rows sharded across ranks, a replicated tensor)

Answer: {"ranks": [{"signaled": bool, "exit": int | null, "done": bool,
"seconds": float | null, "ops": int | null, "error": str | null}], "waited":
seconds} (``ops``: storage operations of a save that finished).

The states (``make_state``, ``dist_state``, ``dist_expected``) are the
module's public helpers: the tests import them to check what was saved.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import signal
import socket
import sys
import time

import torch

import tensorckpt

SHARD_BYTES = 256 << 10  # several stored objects per tensor: more places to be killed in
ROWS, COLS, TENSORS = 256, 1024, 4  # 4 x 1 MiB float32 per state (dist: 2 x 1 MiB per rank)


def make_state(step: int) -> dict:
    """The state saved as step (or version) ``step``: deterministic, all distinct."""
    g = torch.Generator().manual_seed(1000 + step)
    model = {f"w{i}": torch.randn(ROWS, COLS, generator=g) for i in range(TENSORS)}
    model["b"] = torch.randn(COLS, generator=g).to(torch.bfloat16)
    model["ids"] = torch.arange(17, dtype=torch.int64) * (step + 1)
    return {"model": model, "step": step, "cfg": {"tag": f"v{step}", "lr": [0.1, step]}}


def empty_like_state(step: int = 0) -> dict:
    """A target to load into: the same keys, shapes and dtypes, garbage values."""
    s = make_state(0)
    for k, t in s["model"].items():
        s["model"][k] = torch.full_like(t, -7)
    s["step"] = -1
    s["cfg"] = {"tag": None, "lr": None}
    return s


def _full(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randn(world * ROWS, COLS, generator=g)


def dist_state(step: int, rank: int, world: int) -> dict:
    full = _full(step, world)
    rows = tensorckpt.ShardedTensor(full[rank * ROWS:(rank + 1) * ROWS].clone(), tuple(full.shape), (rank * ROWS, 0))
    g = torch.Generator().manual_seed(9000 + step)
    return {"rows": rows, "rep": torch.randn(ROWS, COLS, generator=g), "step": step}


def dist_expected(step: int, world: int) -> dict:
    g = torch.Generator().manual_seed(9000 + step)
    return {"rows": _full(step, world), "rep": torch.randn(ROWS, COLS, generator=g), "step": step}


# ---------------------------------------------------------------- writers


def _say(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _arm(kill_at: int | None) -> list[int]:
    """Count the storage operations of the protocol (kvstore writes, deletes,
    copies, syncs; the commit's and the retention's renames and root write)
    and, if ``kill_at`` is given, SIGKILL this process just before that one."""
    import types

    from tensorckpt import manager
    from tensorckpt.storage import commit_local, kv

    count = [0]

    def wrap(fn):
        def op(*a, **kw):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **kw)

        return op

    for name in ("write", "delete", "delete_all", "copy_all", "sync_tree", "sync_files", "fsync_dir", "write_many_async"):
        setattr(kv, name, wrap(getattr(kv, name)))
    for module in (commit_local, manager):
        fake = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
        fake.rename = wrap(os.rename)
        module.os = fake
    commit_local.open = wrap(open)
    return count


def _writer(cmd: dict, rank: int, world: int, port: int, fd: int) -> None:
    kind, root, step = cmd["kind"], cmd["root"], cmd["step"]
    if kind == "replace-fallback":
        import errno

        from tensorckpt.storage import commit, commit_local

        real = commit_local.renameat2

        def renameat2(src, dst, flags, *a):  # as on a file system without RENAME_EXCHANGE
            return errno.EINVAL if flags == commit.RENAME_EXCHANGE else real(src, dst, flags, *a)

        commit_local.renameat2 = renameat2
    ops = _arm(cmd.get("kill_at_op") if rank in cmd.get("victims", [0]) else None)
    if kind.startswith("dist-"):
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cmd.get("gloo_timeout", 10)))
        state = dist_state(step, rank, world)
        mgr = tensorckpt.CheckpointManager(root, keep_last=2, reader_grace=0)
        dist.barrier()
        _say(fd, "go")
        t = time.perf_counter()
        if kind == "dist-sync":
            mgr.save(step, state, shard_bytes=SHARD_BYTES)
        else:
            mgr.async_save(step, state, shard_bytes=SHARD_BYTES).wait()
        _say(fd, f"done {time.perf_counter() - t:.6f} {ops[0]}")
        return
    state = make_state(step)
    if kind.startswith("mgr-"):
        mgr = tensorckpt.CheckpointManager(root, keep_last=2, reader_grace=0)
        _say(fd, "go")
        t = time.perf_counter()
        if kind == "mgr-sync":
            mgr.save(step, state, shard_bytes=SHARD_BYTES)
        else:
            mgr.async_save(step, state, shard_bytes=SHARD_BYTES).wait()
    else:
        path = os.path.join(root, "ckpt")
        _say(fd, "go")
        t = time.perf_counter()
        if kind == "replace-async":
            tensorckpt.async_save(state, path, overwrite=True, shard_bytes=SHARD_BYTES).wait()
        else:
            tensorckpt.save(state, path, overwrite=True, shard_bytes=SHARD_BYTES)
    _say(fd, f"done {time.perf_counter() - t:.6f} {ops[0]}")


def _fork_writer(cmd: dict, rank: int, world: int, port: int) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        code = 0
        try:
            os.close(r)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # stdout is the server's answer channel
            _writer(cmd, rank, world, port, w)
        except BaseException as e:  # noqa: BLE001
            try:
                _say(w, "error " + " ".join(f"{type(e).__name__}: {e}".split())[:500])
            except OSError:
                pass
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    os.set_blocking(r, False)
    return pid, r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(cmd: dict) -> dict:
    world = int(cmd.get("world", 1))
    port = _free_port() if world > 1 else 0
    kids = [_fork_writer(cmd, rank, world, port) for rank in range(world)]
    text = {pid: "" for pid, _ in kids}
    status: dict[int, int] = {}
    open_fds = {r: pid for pid, r in kids}

    def pump(timeout: float) -> None:
        if not open_fds:
            time.sleep(timeout)
            return
        ready, _, _ = select.select(list(open_fds), [], [], timeout)
        for fd in ready:
            data = os.read(fd, 65536)
            if data:
                text[open_fds[fd]] += data.decode(errors="replace")
            else:
                os.close(fd)
                del open_fds[fd]

    def reap() -> None:
        for pid, _ in kids:
            if pid not in status:
                got, st = os.waitpid(pid, os.WNOHANG)
                if got:
                    status[pid] = st

    start_by = time.monotonic() + cmd.get("start_timeout", 60)
    while time.monotonic() < start_by and not all("go\n" in text[p] or p in status for p, _ in kids):
        pump(0.005)
        reap()
    t0 = time.monotonic()
    delay = cmd.get("delay")
    if delay is not None:
        while time.monotonic() < t0 + delay:
            pump(max(0.0, min(0.002, t0 + delay - time.monotonic())))
        for rank in cmd.get("victims", [0]):
            pid = kids[rank][0]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    end_by = time.monotonic() + cmd.get("timeout", 60)
    while len(status) < len(kids) and time.monotonic() < end_by:
        pump(0.01)
        reap()
    for pid, _ in kids:  # hung survivors of a dead peer
        if pid not in status:
            os.kill(pid, signal.SIGKILL)
            status[pid] = os.waitpid(pid, 0)[1]
    while open_fds:
        pump(0.05)
    out = []
    for pid, _ in kids:
        st, lines = status[pid], text[pid].splitlines()
        done = next((ln for ln in lines if ln.startswith("done ")), None)
        err = next((ln for ln in lines if ln.startswith("error ")), None)
        out.append({
            "signaled": os.WIFSIGNALED(st),
            "exit": os.WEXITSTATUS(st) if os.WIFEXITED(st) else None,
            "done": done is not None,
            "seconds": float(done.split()[1]) if done else None,
            "ops": int(done.split()[2]) if done else None,
            "error": err[6:] if err else None,
        })
    return {"ranks": out, "waited": round(time.monotonic() - t0, 3)}


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = trial(json.loads(line))
        except Exception as e:  # noqa: BLE001
            answer = {"server_error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
