"""The names a module's tensors are stored under (spec: training-state.md 3.1,
4.1): canonical FQNs without wrapper prefixes, renamed views (pipeline
stages), and tied tensors.

- **Wrappers.** DDP (``module.``), FSDP1 (``_fsdp_wrapped_module.``),
  ``torch.compile`` (``_orig_mod.``) and activation checkpointing
  (``_checkpoint_wrapped_module.``) add a component to the names of the
  wrapped module's parameters. The stored name leaves out exactly the
  components torch's ``torch.distributed.checkpoint.state_dict._get_fqns``
  leaves out: the checkpoint wrapper's anywhere, the others only as the
  attribute of an instance of their wrapper type (a user's own submodule
  named ``module`` keeps its name).
- **Renamed views.** :class:`Renamed` is a module seen under other names
  (:func:`tensorckpt.shift_layers` of a module: a pipeline stage's layers
  under global numbers); modules and optimizers next to it use those names.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch

from ..errors import IncompatibleStateError

CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
FSDP_WRAPPED = "_fsdp_wrapped_module"
_WRAPPER_NAMES = frozenset({CHECKPOINT_WRAPPED, FSDP_WRAPPED, "module", "_orig_mod"})


class Renamed:
    """``module`` whose (canonical) names are stored as ``rename(name)``.
    Saved and loaded like the module; an optimizer of its parameters in the
    same state uses the new names."""

    def __init__(self, module: torch.nn.Module, rename: Callable[[str], str]) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Renamed: expected a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.rename = rename

    def __repr__(self) -> str:
        return f"Renamed({type(self.module).__name__})"


def module_of(obj: torch.nn.Module | Renamed) -> torch.nn.Module:
    return obj.module if isinstance(obj, Renamed) else obj


def _is(obj: object, module: str, name: str) -> bool:
    """``isinstance(obj, module.name)`` without importing ``module`` (importing
    torch._dynamo takes seconds): if it was never imported, no instance exists."""
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


def sharded_fsdp1(module: torch.nn.Module) -> torch.nn.Module | None:
    """A submodule of ``module`` that is an FSDP1 ``FullyShardedDataParallel``
    sharding its parameters (any strategy but NO_SHARD): its parameters are
    flat local shards, not the logical parameters."""
    for m in module.modules():
        if _is(m, "torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"):
            strategy = getattr(m, "sharding_strategy", None)
            if getattr(strategy, "name", "NO_SHARD") != "NO_SHARD":
                return m
    return None


def _skipped(parent: object, component: str) -> bool:
    if component == CHECKPOINT_WRAPPED:
        return True
    if component == "module":
        return isinstance(parent, torch.nn.parallel.DistributedDataParallel)
    if component == FSDP_WRAPPED:
        return _is(parent, "torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel")
    if component == "_orig_mod":
        return _is(parent, "torch._dynamo.eval_frame", "OptimizedModule")
    return False


def canonical(module: torch.nn.Module, name: str) -> str:
    """``name`` (a key of ``module.state_dict()`` or of ``named_parameters()``)
    without the wrapper components."""
    parts = name.split(".")
    if _WRAPPER_NAMES.isdisjoint(parts):
        return name
    out: list[str] = []
    node: object = module
    for component in parts:
        if node is not None and _skipped(node, component):
            node = getattr(node, component, None)
            continue
        out.append(component)
        node = node._modules.get(component) if isinstance(node, torch.nn.Module) else None
    return ".".join(out)


def namer(obj: torch.nn.Module | Renamed) -> Callable[[str], str]:
    """The stored name of each of ``obj``'s own names (a module or a
    :class:`Renamed`)."""
    module = module_of(obj)
    rename = obj.rename if isinstance(obj, Renamed) else None
    if rename is None:
        return lambda name: canonical(module, name)
    return lambda name: rename(canonical(module, name))


def stored_names(obj: torch.nn.Module | Renamed, names: Iterable[str], where: str) -> dict[str, str]:
    """``{stored name: own name}`` for ``names``; two own names with one
    stored name are an error."""
    name_of = namer(obj)
    out: dict[str, str] = {}
    for own in names:
        s = name_of(own)
        if s in out and out[s] != own:
            raise IncompatibleStateError(
                f"{where!r}: the module's keys {out[s]!r} and {own!r} both have the canonical name {s!r} "
                "(wrapper prefixes left out); rename one of the submodules"
            )
        out[s] = own
    return out


def identity(t: torch.Tensor) -> tuple | None:
    """What makes two tensors the same tensor (one view of one storage:
    ``state_dict()`` returns a new detached view of a parameter each time),
    or None when that cannot be told (meta, empty, no storage)."""
    if type(t).__module__.startswith("torch.distributed._shard"):  # torch's legacy ShardedTensor: no ties told
        return None
    local = t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t
    if not isinstance(local, torch.Tensor) or local.device.type == "meta" or local.numel() == 0:
        return None
    try:
        ptr = local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without storage
        return None
    if ptr == 0:
        return None
    placements = tuple(map(str, t.placements)) if hasattr(t, "placements") else None
    return (type(t).__name__, str(local.device), ptr, local.storage_offset(), tuple(local.shape), local.stride(),
            local.dtype, placements)
