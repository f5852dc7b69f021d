"""The data-type table (spec section "Data types"): torch dtype <-> Zarr v3
``data_type`` <-> numpy dtype, and zero-copy views between torch and numpy.

Zarr v3 core has no bfloat16 or float8; for those the array's ``data_type`` is
the name TensorStore uses (``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``) and
numpy sees the ml_dtypes type of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from ..errors import CorruptCheckpointError, UnsupportedValueError


@dataclass(frozen=True)
class DType:
    torch_name: str  # str(torch dtype) without "torch."
    zarr_name: str  # Zarr v3 data_type
    numpy: np.dtype  # what TensorStore and zarr-python return
    itemsize: int
    view_as: torch.dtype | None = None  # torch dtype of the same size numpy can hold
    fill_value: object = 0  # JSON fill_value written in zarr.json


def _d(torch_name: str, zarr_name: str, np_type: type, view_as: torch.dtype | None = None, fill: object = 0) -> DType:
    npd = np.dtype(np_type)
    return DType(torch_name, zarr_name, npd, npd.itemsize, view_as, fill)


_TABLE = [
    _d("float64", "float64", np.float64, fill=0.0),
    _d("float32", "float32", np.float32, fill=0.0),
    _d("float16", "float16", np.float16, fill=0.0),
    _d("bfloat16", "bfloat16", ml_dtypes.bfloat16, torch.int16, 0.0),
    _d("float8_e4m3fn", "float8_e4m3fn", ml_dtypes.float8_e4m3fn, torch.uint8, 0.0),
    _d("float8_e5m2", "float8_e5m2", ml_dtypes.float8_e5m2, torch.uint8, 0.0),
    _d("int8", "int8", np.int8),
    _d("int16", "int16", np.int16),
    _d("int32", "int32", np.int32),
    _d("int64", "int64", np.int64),
    _d("uint8", "uint8", np.uint8),
    _d("bool", "bool", np.bool_, fill=False),
    _d("complex64", "complex64", np.complex64, fill=[0.0, 0.0]),
    _d("complex128", "complex128", np.complex128, fill=[0.0, 0.0]),
]
BY_TORCH = {d.torch_name: d for d in _TABLE}
BY_ZARR = {d.zarr_name: d for d in _TABLE}


def torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def for_torch(dtype: torch.dtype, key: str = "?") -> DType:
    d = BY_TORCH.get(torch_name(dtype))
    if d is None:
        raise UnsupportedValueError(
            f"tensor {key!r} has dtype {dtype}, which tensorckpt cannot store; "
            f"supported: {', '.join(BY_TORCH)}"
        )
    return d


def for_name(name: object, where: str) -> DType:
    """Look up a stored torch dtype name (untrusted)."""
    d = BY_TORCH.get(name) if isinstance(name, str) else None
    if d is None:
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r}")
    return d


def torch_dtype(d: DType) -> torch.dtype:
    return getattr(torch, d.torch_name)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing memory with a CPU tensor (any strides)."""
    d = for_torch(t.dtype)
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # a copy: lazy conj/neg views have no plain memory
    if d.view_as is not None:
        return t.view(d.view_as).numpy().view(d.numpy)
    return t.numpy()


def from_numpy(a: np.ndarray, d: DType) -> torch.Tensor:
    """A tensor sharing memory with a numpy array of ``d.numpy`` type."""
    if d.view_as is not None:
        return torch.from_numpy(a.view(np.dtype(str(d.view_as).removeprefix("torch.")))).view(torch_dtype(d))
    return torch.from_numpy(a)
