"""Random number generators of every rank, as logical tensors (spec:
rng-and-data.md, "RNG state").

``tensorckpt.rng_state()`` stands for "this process's generators" in a state:

    tensorckpt.save({"model": model, "rng": tensorckpt.rng_state()}, path)
    tensorckpt.load({"model": model, "rng": tensorckpt.rng_state()}, path)

Saving captures, on every rank, torch's CPU generator, the current CUDA
device's generator (when CUDA is available; call ``torch.cuda.set_device``
first, as training does), numpy's global generator and
Python's ``random``. Each generator is one tensor with a leading world
dimension (``rng/torch`` is ``[world, 5056]`` uint8); rank r writes row r as a
:class:`ShardedTensor`. Python and numpy states are encoded as int64 rows, so
nothing is pickled.

Loading gives rank r its own row when the checkpoint has one (r < the saved
world); ranks beyond it seed every generator from :func:`derive_seed` (saved
rank 0's torch row and r), so growing the world is deterministic, and rows of
ranks that no longer exist are ignored. Each rank reads only the row it needs.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable, Mapping
from typing import cast

import numpy as np
import torch

from ..errors import CorruptCheckpointError, IncompatibleStateError
from .base import Context, Stored, Target, key_in_state
from .sharded import ShardedTensor

PY_WIDTH = 628  # [version, 624 MT words, position, has_gauss, gauss bits]
NP_WIDTH = 627  # [624 MT words, position, has_gauss, gauss bits]
_DERIVE_TAG = b"tensorckpt/rng/v1\x00"


class RNGState:
    """Marks where the generators of this process go in a state; the state
    itself is taken at ``save`` and put back at ``load``."""

    def __repr__(self) -> str:
        return "tensorckpt.rng_state()"


def rng_state() -> RNGState:
    """The random number generators of this process (torch CPU, current CUDA
    device, numpy's global generator, Python's ``random``), to put in a state
    given to :func:`tensorckpt.save` / :func:`tensorckpt.load`."""
    return RNGState()


def derive_seed(rank0_torch_row: bytes, rank: int) -> int:
    """The seed of a rank the checkpoint has no row for: the first 8 bytes,
    little-endian, of SHA-256(tag, saved rank 0's torch state, rank as 8
    bytes little-endian)."""
    digest = hashlib.sha256(_DERIVE_TAG + bytes(rank0_torch_row) + rank.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little")


# ------------------------------------------------------------- encodings


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def encode_python(state: tuple) -> torch.Tensor:
    version, internal, gauss = state
    return torch.tensor([version, *internal, gauss is not None, _float_bits(gauss or 0.0)], dtype=torch.int64)


def decode_python(row: list[int]) -> tuple:
    if len(row) != PY_WIDTH or row[0] != 3 or not all(0 <= w < 2**32 for w in row[1:625]) or row[626] not in (0, 1):
        raise ValueError(f"expected {PY_WIDTH} int64 [3, 624 words < 2^32, position, 0|1, float bits]")
    return (3, tuple(row[1:626]), _bits_float(row[627]) if row[626] else None)


def encode_numpy(state: tuple) -> torch.Tensor:
    name, keys, pos, has_gauss, gauss = state
    if name != "MT19937":  # the legacy global generator is always MT19937
        raise IncompatibleStateError(f"numpy's global generator is {name}, not MT19937")
    words = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    return torch.cat([words, torch.tensor([pos, has_gauss, _float_bits(gauss)], dtype=torch.int64)])


def decode_numpy(row: list[int]) -> tuple:
    if len(row) != NP_WIDTH or not all(0 <= w < 2**32 for w in row[:624]) or row[625] not in (0, 1):
        raise ValueError(f"expected {NP_WIDTH} int64 [624 words < 2^32, position, 0|1, float bits]")
    return ("MT19937", np.array(row[:624], dtype=np.uint32), row[624], row[625], _bits_float(row[626]))


def capture() -> dict[str, torch.Tensor]:
    """This process's generator states, one 1-D row each."""
    rows = {
        "torch": torch.get_rng_state(),
        # legacy=True (also the default) gives the tuple form for an MT19937 generator, as the global one
        # always is; numpy's stubs type the call without it as the dict form (legacy=False)
        "numpy": encode_numpy(cast(tuple, np.random.get_state(legacy=True))),
        "python": encode_python(random.getstate()),
    }
    if torch.cuda.is_available():  # pragma: no cover - no CUDA in the test environment
        rows["cuda"] = torch.cuda.get_rng_state()
    return rows


# ---------------------------------------------------------------- adapter

_DTYPES = {"torch": torch.uint8, "numpy": torch.int64, "python": torch.int64, "cuda": torch.uint8}
_WIDTHS = {"torch": torch.get_rng_state().numel(), "numpy": NP_WIDTH, "python": PY_WIDTH}


class RNGAdapter:
    """One row per rank of each generator; ``load_target``'s memo for
    ``apply``: the generators the checkpoint holds."""

    def save_state(self, obj: RNGState, ctx: Context) -> dict:
        return {
            name: ShardedTensor(row.reshape(1, -1), (ctx.world, row.numel()), (ctx.rank, 0))
            for name, row in capture().items()
        }

    def load_target(self, obj: RNGState, stored: Stored, ctx: Context) -> Target:
        out = {}
        for name, dtype in _DTYPES.items():
            entry = stored.tensors.get(name)
            if entry is None:
                if name != "cuda":  # ask for a save at this world's row, so load reports the key missing
                    out[name] = ShardedTensor(torch.zeros(1, _WIDTHS[name], dtype=dtype), (ctx.world, _WIDTHS[name]), (ctx.rank, 0))
                continue
            shape = tuple(entry.shape)
            if len(shape) != 2 or shape[0] < 1:
                raise CorruptCheckpointError(
                    f"{_key(obj, ctx, name)!r} is stored as {list(shape)}; an RNG state is [world >= 1, width]"
                )
            if ctx.rank < shape[0]:
                row = ctx.rank  # its own row
            elif name == "torch":
                row = 0  # saved rank 0's state, to derive this rank's seed
            else:
                row = None
            rows = 0 if row is None else 1
            out[name] = ShardedTensor(torch.zeros(rows, shape[1], dtype=dtype), shape, (row or 0, 0))
        return Target(out, memo=frozenset(stored.tensors))

    def apply(self, obj: RNGState, loaded: Mapping, ctx: Context, held: frozenset) -> None:
        if "torch" not in held:  # strict=False and no RNG state stored: generators unchanged
            return
        t = loaded["torch"]
        if t.global_offset[0] != ctx.rank:  # no row for this rank: derive every generator
            seed = derive_seed(t.local[0].numpy().tobytes(), ctx.rank)
            torch.manual_seed(seed)  # also seeds every CUDA device
            np.random.seed(seed % 2**32)
            random.seed(seed)
            return
        own = {name: loaded[name].local[0] for name in ("torch", "numpy", "python", "cuda") if name in held}
        for name, setter in (("torch", torch.set_rng_state), ("numpy", _set_numpy), ("python", _set_python)):
            if name in own:
                _restore(obj, ctx, name, setter, own[name])
        if "cuda" in own and torch.cuda.is_available():  # pragma: no cover - no CUDA in the test environment
            _restore(obj, ctx, "cuda", torch.cuda.set_rng_state, own["cuda"])


def _set_numpy(row: torch.Tensor) -> None:
    np.random.set_state(decode_numpy(row.tolist()))


def _set_python(row: torch.Tensor) -> None:
    random.setstate(decode_python(row.tolist()))


def _restore(
    obj: RNGState, ctx: Context, name: str, setter: Callable[[torch.Tensor], None], row: torch.Tensor
) -> None:
    try:
        setter(row.clone())
    except (ValueError, TypeError, RuntimeError) as e:
        raise CorruptCheckpointError(
            f"{_key(obj, ctx, name)!r}: row {ctx.rank} is not a {name} generator state ({e}); "
            "the checkpoint was not written by rng_state() of a compatible version"
        ) from None


def _key(obj: RNGState, ctx: Context, name: str) -> str:
    return f"{key_in_state(obj, ctx.state)}/{name}"
