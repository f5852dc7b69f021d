"""tensorckpt: distributed training checkpoints stored as logical Zarr v3
arrays, written and read through TensorStore, resharded at load time.

    import tensorckpt
    tensorckpt.save({"model": model.state_dict(), "step": 10}, "ckpt/step10")
    state = {"model": model.state_dict(), "step": 0}
    tensorckpt.load(state, "ckpt/step10")
    tensorckpt.open("ckpt/step10").read("model/fc.weight", index=(slice(0, 4),))
"""

__version__ = "0.1.0"

import os
from collections.abc import Mapping
from typing import Any

import tensorckpt_zarr_dtypes as _zarr_dtypes

from . import cli  # noqa: F401 - tensorckpt.cli (cli.inspect) is public
from .adapters.per_rank import per_rank
from .adapters.pipeline import shift_layers, stage_offset
from .adapters.registry import register as register_adapter
from .adapters.rng import rng_state
from .adapters.sharded import ShardedTensor
from .checkpoint import Checkpoint, CheckpointMetadata, TensorInfo
from .clean import CleanReport, clean
from .data import ResumableSampler
from .engine.async_save import AsyncSaver, SaveHandle, async_save
from .engine.load import LoadStats, load
from .engine.save import SaveStats, save
from .errors import (
    CheckpointChangedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CorruptCheckpointError,
    IncompatibleStateError,
    IncompleteCheckpointError,
    InvalidIndexError,
    InvalidPathError,
    NotACheckpointError,
    TensorckptError,
    UnsupportedValueError,
    UnsupportedVersionError,
)
from .format.metadata import FORMAT_VERSION
from .interchange import convert, load_safetensors
from .manager import CheckpointManager, StepInfo
from .verify import VerifyReport, verify

_zarr_dtypes.register()  # zarr-python in this process reads bfloat16/float8 arrays too


def open(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> Checkpoint:  # noqa: A001 - the public name the API promises
    """Open a committed checkpoint read-only (no process group needed);
    ``storage_options`` as in :func:`tensorckpt.save`."""
    return Checkpoint(path, storage_options=storage_options)


__all__ = [
    "save", "async_save", "AsyncSaver", "SaveHandle", "load", "open", "ShardedTensor", "LoadStats", "SaveStats",
    "shift_layers", "stage_offset", "Checkpoint", "CheckpointMetadata", "TensorInfo", "FORMAT_VERSION",
    "TensorckptError", "CheckpointNotFoundError", "CheckpointExistsError", "CheckpointChangedError",
    "CheckpointPermissionError", "NotACheckpointError", "IncompleteCheckpointError",
    "UnsupportedVersionError", "CorruptCheckpointError", "IncompatibleStateError",
    "UnsupportedValueError", "InvalidPathError", "InvalidIndexError",
    "rng_state", "ResumableSampler", "per_rank",
    "verify", "VerifyReport", "clean", "CleanReport",
    "CheckpointManager", "StepInfo",
    "register_adapter",
    "convert", "load_safetensors",
]
