"""One exception hierarchy for everything tensorckpt raises on purpose.

Every error is a :class:`TensorckptError`; where a builtin fits, the error also
inherits it (a missing checkpoint is a ``FileNotFoundError``, an incompatible
state a ``ValueError``), so callers can catch either. Messages name the key,
the path and what to do.
"""

from __future__ import annotations


class TensorckptError(Exception):
    """Base class of every error tensorckpt raises on purpose."""


class CheckpointNotFoundError(TensorckptError, FileNotFoundError):
    """No checkpoint (committed or not) exists at the path."""


class CheckpointExistsError(TensorckptError, FileExistsError):
    """A save would replace an existing checkpoint and ``overwrite`` is False."""


class IncompleteCheckpointError(TensorckptError):
    """Data exists at the path but the checkpoint was never committed."""


class UnsupportedVersionError(TensorckptError):
    """The checkpoint needs a format version or extension this reader lacks."""


class CorruptCheckpointError(TensorckptError):
    """Metadata or chunk data is malformed, inconsistent or fails its checksum."""


class IncompatibleStateError(TensorckptError, ValueError):
    """The state passed to ``load`` does not match what was stored
    (missing or unexpected keys, a different shape or dtype)."""


class UnsupportedValueError(TensorckptError, TypeError):
    """A state value cannot be stored (not a tensor nor JSON-able data)."""


class InvalidPathError(TensorckptError, ValueError):
    """A checkpoint path or URL cannot be parsed or uses an unknown scheme."""


class InvalidIndexError(TensorckptError, IndexError):
    """A region requested from a stored tensor is out of bounds or malformed."""


class CheckpointChangedError(TensorckptError):
    """The checkpoint was replaced or deleted while it was being read.
    Nothing mixed from two versions was returned; reading again (open or
    load again) sees the checkpoint now at the path."""


class NotACheckpointError(TensorckptError, ValueError):
    """The path holds something that is not a tensorckpt checkpoint (a torch
    DCP directory, a safetensors or torch.save file, a Hugging Face model, a
    CheckpointManager root); the message says what it is and how to use it."""


class CheckpointPermissionError(TensorckptError, PermissionError):
    """A stored object exists but this process may not read it (file
    permissions): not corruption; fix the permissions or read as its owner."""
