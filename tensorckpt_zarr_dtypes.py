"""zarr-python data types for ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2``.

TensorStore's ``zarr3`` driver writes arrays whose ``data_type`` is one of these
names; stock zarr-python 3.x cannot open them. This module defines one ``ZDType``
per name, backed by the ``ml_dtypes`` NumPy types, so zarr-python reads and
writes them bit-exactly (NaN payloads included).

tensorckpt exposes the classes through the ``zarr.data_type`` entry point group,
which zarr-python collects at import. zarr-python 3.1.x collects these entry points
but never loads them, though. So before opening such arrays, call :func:`register`
or flush zarr's pending list with ``zarr.dtype.data_type_registry._lazy_load()``.

This file imports only zarr, numpy and ml_dtypes. You can copy it into a project
that has only zarr-python.

Fill values use the Zarr v3 float encoding: a JSON number, ``"NaN"``, ``"Infinity"``,
``"-Infinity"``, or ``"0x…"`` with the exact bit pattern (e.g. ``"0x7fc0"``). To
match TensorStore, only the canonical quiet NaN is written as ``"NaN"``. Any other
NaN is written as hex. ``float8_e4m3fn`` has no infinities, so it rejects
``"Infinity"``.

Caveat when writing with zarr-python 3.1: by default, zarr skips a chunk that
equals the fill value numerically, e.g. all -0.0 with fill 0.0, or a NaN with a
different payload. That chunk then reads back as the fill value. For bit-exact
writes, pass ``config={"write_empty_chunks": True}``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from string import hexdigits
from typing import TYPE_CHECKING, Any, ClassVar, Self, cast

import ml_dtypes
import numpy as np
from zarr.core.dtype.common import DataTypeValidationError, HasEndianness, HasItemSize
from zarr.dtype import ZDType, data_type_registry

if TYPE_CHECKING:
    from zarr.core.common import JSON, ZarrFormat
    from zarr.core.dtype.common import DTypeConfig_V2, DTypeJSON

__all__ = ["BFloat16", "Float8E4M3FN", "Float8E5M2", "register"]


@dataclass(frozen=True, kw_only=True)
class _MLFloat(ZDType[np.dtype[Any], np.generic], HasItemSize):
    """Shared logic. The Zarr v2 dtype name equals the v3 name, as TensorStore writes it."""

    scalar_type: ClassVar[type[np.generic]]
    has_inf: ClassVar[bool] = True

    @property
    def item_size(self) -> int:
        return np.dtype(self.scalar_type).itemsize

    @classmethod
    def from_native_dtype(cls, dtype: np.dtype[Any]) -> Self:
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(f"Invalid data type {dtype}, expected {cls._zarr_v3_name}")

    def to_native_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.scalar_type)

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Self:
        if data == {"name": cls._zarr_v3_name, "object_codec_id": None}:
            return cls()
        raise DataTypeValidationError(f"Invalid v2 JSON for {cls.__name__}: {data!r}")

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Self:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(f"Invalid v3 JSON for {cls.__name__}: {data!r}")

    def to_json(  # type: ignore[override]
        self, zarr_format: ZarrFormat
    ) -> DTypeConfig_V2[str, None] | str:
        if zarr_format == 2:
            return {"name": self._zarr_v3_name, "object_codec_id": None}
        return self._zarr_v3_name

    def _check_scalar(self, data: object) -> bool:
        return isinstance(data, int | float | str | np.generic)

    def cast_scalar(self, data: object) -> np.generic:
        if isinstance(data, str):
            return self.from_json_scalar(data, zarr_format=3)
        if self._check_scalar(data):
            return self.scalar_type(data)
        raise TypeError(f"Cannot convert {data!r} to a scalar of data type {self._zarr_v3_name}")

    def default_scalar(self) -> np.generic:
        return self.scalar_type(0)

    def _bits(self, value: object) -> int:
        return int(np.array(value, dtype=self.scalar_type).view(f"u{self.item_size}"))

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> np.generic:
        """A number, "NaN", "Infinity", "-Infinity", or "0x" + the exact bit pattern."""
        if isinstance(data, str) and data[:2] in ("0x", "0X"):
            digits = data[2:]
            if len(digits) != 2 * self.item_size or not all(c in hexdigits for c in digits):
                raise TypeError(f"Invalid hex fill value {data!r} for {self._zarr_v3_name}")
            bits = np.array(int(digits, 16), dtype=f"u{self.item_size}")
            return cast(np.generic, bits.view(self.scalar_type)[()])
        if data in ("Infinity", "-Infinity") and not self.has_inf:
            raise TypeError(f"{self._zarr_v3_name} has no infinities; got fill value {data!r}")
        if isinstance(data, int | float | str) and not isinstance(data, bool):
            try:  # float() also parses "NaN", "Infinity" and "-Infinity"
                return self.scalar_type(float(data))
            except ValueError:
                pass
        raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}")

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:
        """Like TensorStore: a number, "Infinity"/"-Infinity", "NaN" for the canonical
        NaN, and "0x..." for any other NaN (Zarr v2 has no hex form: always "NaN")."""
        scalar = self.cast_scalar(data)
        value = float(scalar)
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        if math.isnan(value):
            bits = self._bits(scalar)
            if zarr_format == 2 or bits == self._bits(self.scalar_type("nan")):
                return "NaN"
            return f"0x{bits:0{2 * self.item_size}x}"
        return value


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat, HasEndianness):
    """``bfloat16``: 1 sign, 8 exponent and 7 mantissa bits, IEEE-style inf/NaN."""

    scalar_type = ml_dtypes.bfloat16
    dtype_cls = type(np.dtype(ml_dtypes.bfloat16))
    _zarr_v3_name = "bfloat16"

    @classmethod
    def from_native_dtype(cls, dtype: np.dtype[Any]) -> Self:
        if cls._check_native_dtype(dtype):
            big = dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big")
            return cls(endianness="big" if big else "little")
        raise DataTypeValidationError(f"Invalid data type {dtype}, expected {cls._zarr_v3_name}")

    def to_native_dtype(self) -> np.dtype[Any]:
        order = "<" if self.endianness == "little" else ">"
        return cast("np.dtype[Any]", np.dtype(self.scalar_type).newbyteorder(order))

    def to_json(  # type: ignore[override]
        self, zarr_format: ZarrFormat
    ) -> DTypeConfig_V2[str, None] | str:
        if zarr_format == 2 and self.endianness != "little":
            raise ValueError("Zarr v2 'bfloat16' is little-endian only")
        return super().to_json(zarr_format)


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """``float8_e4m3fn``: 1 sign, 4 exponent, 3 mantissa bits; no infinities, NaN 0x7f/0xff."""

    scalar_type = ml_dtypes.float8_e4m3fn
    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3fn))
    _zarr_v3_name = "float8_e4m3fn"
    has_inf = False


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """``float8_e5m2``: 1 sign, 5 exponent and 2 mantissa bits, IEEE-style inf/NaN."""

    scalar_type = ml_dtypes.float8_e5m2
    dtype_cls = type(np.dtype(ml_dtypes.float8_e5m2))
    _zarr_v3_name = "float8_e5m2"


def register() -> None:
    """Register the three data types with zarr-python. Calling it again does nothing."""
    for cls in (BFloat16, Float8E4M3FN, Float8E5M2):
        data_type_registry.register(cls._zarr_v3_name, cls)
