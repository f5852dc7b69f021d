"""The few collectives a save or load needs, over a torch.distributed process
group, or trivially in a single process. Errors are collective too: when any
rank fails a step, every rank raises the same error instead of hanging."""

from __future__ import annotations

import builtins

import torch
import torch.distributed as dist

from .. import errors


class Group:
    def __init__(self, process_group=None) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if process_group is not None and not initialized:
            raise errors.TensorckptError("process_group given but torch.distributed is not initialized")
        self.pg = process_group
        self.distributed = initialized and dist.get_world_size(process_group) > 1
        self.rank = dist.get_rank(process_group) if initialized else 0
        self.size = dist.get_world_size(process_group) if initialized else 1

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.pg, group_rank) if self.pg is not None else group_rank

    def gather(self, obj) -> list | None:
        """Everyone's ``obj`` on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._global(0), group=self.pg)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.pg)
        return box[0]

    def all_to_all(self, data: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """Bytes to every rank and from every rank, in one collective.
        ``data`` (a 1-D uint8 CPU tensor) holds ``send_sizes[j]`` bytes for
        rank ``j``, in rank order; the result (on the CPU) holds
        ``recv_sizes[j]`` bytes from rank ``j``, in rank order. Every rank of
        the group must call it. Gloo takes the CPU tensors as they are (uneven
        sizes included); a group without a CPU backend (NCCL) gets copies on
        the current accelerator."""
        if not self.distributed:
            return data[: recv_sizes[0]].clone()
        device = self._device()
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, data.to(device), recv_sizes, send_sizes, group=self.pg)
        return out.cpu()

    def _device(self) -> torch.device:
        """Where this group's collectives take tensors, as for torch's object
        collectives: the CPU when the group has a CPU backend (gloo, MPI, or
        a ``cpu:`` pair in a multi-backend group), else the current accelerator."""
        backend = str(dist.get_backend(self.pg))
        if backend in ("gloo", "mpi") or "cpu:" in backend:
            return torch.device("cpu")
        kind = torch.accelerator.current_accelerator()
        if kind is None:
            raise errors.TensorckptError(
                f"process group backend {backend!r} takes no CPU tensors and no accelerator is present; "
                "save over a gloo group (process_group=...)"
            )
        return torch.device(kind.type, getattr(torch, kind.type).current_device())

    def all_gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out


def capture(fn, *args):
    """Run ``fn``; return (result, None) or (None, error) for shipping to peers."""
    try:
        return fn(*args), None
    except Exception as e:  # shipped to every rank, re-raised there by class name
        return None, (type(e).__name__, str(e))


def reraise(err: tuple[str, str] | None, rank: int | None = None) -> None:
    """Raise a shipped error on this rank, as the same tensorckpt class where possible."""
    if err is None:
        return
    name, msg = err
    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls, msg = errors.TensorckptError, f"{name}: {msg}"
    prefix = f"(on rank {rank}) " if rank is not None else ""
    raise cls(prefix + msg)
