"""The few collectives a save or load needs, over a torch.distributed process
group, or trivially in a single process.

Errors are collective too: every step that may fail on some ranks runs
through :meth:`Group.collective` (the shape of DCP's ``_DistWrapper.all_reduce``):
each rank runs a local function, the results or failures are gathered, and
when any rank failed, every rank raises one :class:`~tensorckpt.errors.TensorckptError`
naming every failing rank, its exception type and message. The first failure's
class is kept, so ``except CorruptCheckpointError`` works on every rank.
Failures cross ranks as :class:`Failure` (rank, class name, message), nothing else.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import errors


def group_key(process_group: object | None) -> object | None:
    """The group object ``process_group`` stands for, to key per-group state
    by (the object itself, never its ``id``, which a later group may reuse):
    ``process_group``, or for None the default group once torch.distributed is
    initialized, else None (a single process)."""
    if process_group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return process_group


class Group:
    """A process group as save and load use it (None: the default group; a
    single process when torch.distributed is not initialized): its rank and
    size, the collectives below, and :meth:`collective`, the one way a step
    that may fail on some ranks runs."""

    def __init__(self, process_group: Any = None) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if process_group is not None and not initialized:
            raise errors.TensorckptError("process_group given but torch.distributed is not initialized")
        self.pg = process_group
        self.distributed = initialized and dist.get_world_size(process_group) > 1
        self.rank = dist.get_rank(process_group) if initialized else 0
        self.size = dist.get_world_size(process_group) if initialized else 1

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.pg, group_rank) if self.pg is not None else group_rank

    def gather(self, obj: Any) -> list | None:
        """Everyone's ``obj`` on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._global(0), group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
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

    def all_gather(self, obj: Any) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def collective(
        self,
        local: Callable[[], Any] | None,
        reduce: Callable[[list], Any] | None = None,
        *,
        what: str,
        on_failure: Callable[[], None] | None = None,
    ) -> Any:
        """Run ``local()`` on every rank; return every rank's result (a list
        by rank, on every rank), or, with ``reduce``, ``reduce(results)``
        computed on rank 0 and broadcast. ``local=None``: rank 0 alone runs
        ``reduce([])`` (one broadcast, no gather).

        If ``local`` fails on any rank, or ``reduce`` fails, ``on_failure()``
        runs on every rank and then every rank raises the same error (see
        :func:`combined`); ``what`` names the step in its message ("save",
        "load"). In a single process the original exception is raised as it
        is. One collective (all-gather), or two (gather + broadcast) with
        ``reduce``."""
        if not self.distributed:
            try:
                results = [local()] if local is not None else []
                return results if reduce is None else reduce(results)
            except BaseException:
                if on_failure is not None:
                    on_failure()
                raise
        try:
            return self._collective(local, reduce, what, on_failure)
        except errors.TensorckptError:  # a failure of some rank, already shared (it may also be a RuntimeError)
            raise
        except RuntimeError as e:  # the transport (gloo) failed: a peer died or left mid-collective
            if on_failure is not None:
                on_failure()
            raise errors.TensorckptError(
                f"{what}: rank {self.rank} of {self.size} lost its peers during a collective (a rank died or left: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}); nothing was committed by this call and "
                "what this rank could clean up is removed: restart the job and retry") from e

    def _collective(self, local: Callable[[], Any] | None, reduce: Callable[[list], Any] | None, what: str,
                    on_failure: Callable[[], None] | None) -> Any:
        mine, exc = attempt(local) if local is not None else (None, None)
        mine_failure = None if exc is None else Failure.of(self.rank, exc)
        if reduce is None:
            everyone = self.all_gather((mine, mine_failure))
            failures = [f for _, f in everyone if f is not None]
            out = [r for r, _ in everyone]
        else:
            gathered = self.gather((mine, mine_failure)) if local is not None else None
            decision = None
            if self.rank == 0:
                failures = [f for _, f in gathered if f is not None] if gathered is not None else []
                result = None
                if not failures:
                    result, e = attempt(reduce, [r for r, _ in gathered] if gathered is not None else [])
                    if e is not None:
                        exc = exc or e
                        failures = [Failure.of(0, e)._replace(gathered=True)]
                decision = (result, failures)
            out, failures = self.broadcast(decision)
        if failures:
            if on_failure is not None:
                on_failure()
            raise combined(failures, what, self.size) from exc
        return out


class Failure(NamedTuple):
    """A failure of one rank, as it crosses ranks: the rank (in the group),
    the exception's class name (as in :mod:`tensorckpt.errors` or builtins)
    and its message."""

    rank: int
    cls: str
    message: str
    gathered: bool = False  # raised by rank 0 in the step it does for every rank (``reduce``)

    @classmethod
    def of(cls, rank: int, e: BaseException) -> Failure:
        failures = getattr(e, "failures", None)
        if isinstance(e, errors.TensorckptError) and failures:  # already collective: keep the first one's class
            return cls(rank, failures[0].cls, str(e))
        return cls(rank, type(e).__name__, str(e))


def attempt(fn: Callable, *args: Any) -> tuple[Any, BaseException | None]:
    """``(fn(*args), None)``, or ``(None, the exception)``: a local step whose
    failure is handed to the next collective instead of raised."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - shipped to every rank as a Failure
        return None, e


_REMOTE: dict[str, type] = {}


def _error_class(name: str) -> type:
    """The class every rank raises for a failure of class ``name``: the
    tensorckpt class of that name; for a builtin one (``OSError``), a
    TensorckptError that is also that builtin; else TensorckptError."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.TensorckptError):
        return cls
    base = getattr(builtins, name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or base in (Exception, BaseException):
        return errors.TensorckptError
    if name not in _REMOTE:
        try:
            made = type(name, (errors.TensorckptError, base), {"__module__": "tensorckpt.errors"})
            made("probe")
        except TypeError:  # a builtin with an unusual layout or constructor
            made = errors.TensorckptError
        _REMOTE[name] = made
    return _REMOTE[name]


def combined(failures: list[Failure], what: str, size: int) -> errors.TensorckptError:
    """One error naming every failing rank, of the first failure's class
    (see :func:`_error_class`); its ``failures`` attribute lists them."""
    failures = sorted(failures, key=lambda f: f.rank)
    ranks = [f.rank for f in failures]
    alike: dict[tuple[str, str], list[int]] = {}  # ranks failing the same way are named together
    for f in failures:
        alike.setdefault((f.cls, f.message), []).append(f.rank)
    if failures[0].gathered:
        msg = f"{what} failed on rank 0, which does this step for all {size} ranks: {failures[0].cls}: {failures[0].message}"
    elif len(alike) == 1:
        who = f"rank{'s' if len(ranks) > 1 else ''} {ranks if len(ranks) > 1 else ranks[0]}"
        msg = f"{what} failed on {who} of {size}: {failures[0].cls}: {failures[0].message}"
    else:
        msg = f"{what} failed on ranks {ranks} of {size}:" + "".join(
            f"\n  rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {cls}: {message}"
            for (cls, message), rs in alike.items()
        )
    err = _error_class(failures[0].cls)(msg)
    err.failures = tuple(failures)
    return err


