"""Shared helpers of the checkpoint validator (``validate.py``): CRC-32C, a
listing of the location that never follows links, bounded reads, key
escaping (format-v1.md section 5) and the spec's JSON Schemas. Standard library,
numpy, jsonschema and google_crc32c only (the last two optional); never tensorckpt.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import jsonschema  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - the schema checks are skipped, with a note
    jsonschema = None

_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c_python(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli, RFC 3720) in pure Python: the fallback without google_crc32c."""
    crc ^= 0xFFFFFFFF
    for b in bytes(data):
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


try:
    import google_crc32c as _gcrc

    def crc32c(data: bytes, crc: int = 0) -> int:
        """CRC-32C of ``data``, continuing from ``crc``."""
        return _gcrc.extend(crc, bytes(data)) if crc else _gcrc.value(bytes(data))
except ImportError:  # pragma: no cover - exercised only where google_crc32c is absent
    crc32c = crc32c_python


SCHEMA_DIR = Path(__file__).resolve().parent.parent / "spec" / "schema"
NODE_JSON_CAP = 1 << 20  # largest array / group zarr.json read
WALK_CAP = 10_000_000  # entries listed under the location
MAX_DIM = 2**62

DTYPES: dict[str, tuple[str, int, Any]] = {  # dtype -> (data_type, bytes, fill_value)
    "float64": ("float64", 8, 0.0), "float32": ("float32", 4, 0.0), "float16": ("float16", 2, 0.0),
    "bfloat16": ("bfloat16", 2, 0.0), "float8_e4m3fn": ("float8_e4m3fn", 1, 0.0),
    "float8_e5m2": ("float8_e5m2", 1, 0.0), "int8": ("int8", 1, 0), "int16": ("int16", 2, 0),
    "int32": ("int32", 4, 0), "int64": ("int64", 8, 0), "uint8": ("uint8", 1, 0), "bool": ("bool", 1, False),
    "complex64": ("complex64", 8, [0.0, 0.0]), "complex128": ("complex128", 16, [0.0, 0.0]),
}


# ------------------------------------------------------------------ storage


@dataclass
class Listing:
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size (regular files)
    special: dict[str, str] = field(default_factory=dict)  # relative path -> what it is
    truncated: bool = False


def walk(root: str) -> Listing:
    """Every entry under ``root``, by lstat: links are recorded, never followed."""
    out = Listing()
    stack = [""]
    count = 0
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel) if rel else root))
        except OSError as e:
            if not rel:
                raise
            out.special[rel] = f"a directory that cannot be listed ({e.strerror})"
            continue
        for entry in entries:
            count += 1
            if count > WALK_CAP:
                out.truncated = True
                return out
            path = f"{rel}/{entry.name}" if rel else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as e:
                out.special[path] = f"an entry that cannot be examined ({e.strerror})"
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)
            elif stat.S_ISREG(st.st_mode):
                out.files[path] = st.st_size
            else:
                out.special[path] = _kind(st.st_mode)
    return out


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or special file"


def open_file(root: str, rel: str) -> int:
    """Open a listed regular file without following a link or blocking."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(os.path.join(root, rel), flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(0, "not a regular file")
    return fd


def pread(fd: int, n: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < n:
        b = os.pread(fd, n - done, offset + done)
        if not b:
            raise OSError(0, f"the file ended {n - done} bytes early (it changed while it was read)")
        parts.append(b)
        done += len(b)
    return b"".join(parts)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_json(root: str, rel: str, cap: int) -> Any:
    """Parse a listed JSON file; ValueError (with the reason) if it is not valid JSON."""
    try:
        fd = open_file(root, rel)
    except OSError as e:
        raise ValueError(f"cannot be opened ({e.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise ValueError(f"is {size} bytes, more than the validator reads ({cap})")
        data = pread(fd, size, 0)
    except OSError as e:
        raise ValueError(f"cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if data.startswith(b"\xef\xbb\xbf"):
        raise ValueError("starts with a byte order mark")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError("is nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"is not valid JSON ({e})") from None


# ------------------------------------------------------------------ keys (section 5)

_UNSAFE = re.compile(r"[%/\\\x00-\x1f\x7f]")
_PCT = re.compile(r"%([0-9A-Fa-f]{2})")


def escape(name: str) -> str | None:
    """Section 5.1; None where a writer must reject the component."""
    if name == "":
        return "%"
    out = _UNSAFE.sub(lambda m: f"%{ord(m.group(0)):02X}", name)
    if not out.strip("."):
        out = "%2E" * len(out)
    elif out.startswith("__"):
        out = "%5F" + out[1:]
    elif out == "zarr.json":
        out = "zarr%2Ejson"
    if out.endswith(".__lock"):
        out = out[: -len(".__lock")] + "%2E__lock"
    try:
        if len(out.encode("utf-8")) > 255:
            return None
    except UnicodeEncodeError:
        return None
    return out


def key_problem(key: Any) -> str | None:
    """Why ``key`` is not a canonical flat key (5.2, 5.3), or None."""
    if not isinstance(key, str) or key == "":
        return "is empty" if key == "" else "is not a string"
    for part in key.split("/"):
        name = "" if part == "%" else _PCT.sub(lambda m: chr(int(m.group(1), 16)), part)
        again = escape(name)
        if again is None:
            return f"is not in canonical form (component {part!r} is longer than 255 bytes or not Unicode text)"
        if again != part:
            return f"is not in canonical form (component {part!r} encodes back as {again!r})"
    return None


def unescape(part: str) -> str:
    return "" if part == "%" else _PCT.sub(lambda m: chr(int(m.group(1), 16)), part)


def prefixes(key: str) -> Iterator[str]:
    """The proper prefixes of ``key`` at '/' boundaries."""
    i = key.find("/")
    while i != -1:
        yield key[:i]
        i = key.find("/", i + 1)


# ------------------------------------------------------------------ schemas

_VALIDATORS: dict[str, Any] = {}
MISSING_SCHEMAS: set[str] = set()  # schema files not found next to the validator (their checks are skipped)


def schema_errors(schema: str, doc: Any, definition: str | None = None) -> list[Any]:
    """jsonschema errors of ``doc`` against spec/schema/<schema> (or one of its $defs)."""
    if jsonschema is None:
        return []
    name = f"{schema}#{definition}"
    if name not in _VALIDATORS:
        try:
            data = json.loads((SCHEMA_DIR / schema).read_text(encoding="utf-8"))
        except OSError:
            MISSING_SCHEMAS.add(schema)
            return []
        if definition is not None:
            data = {"$ref": f"#/$defs/{definition}", "$defs": data["$defs"]}
        _VALIDATORS[name] = jsonschema.Draft202012Validator(data)
    try:
        return list(_VALIDATORS[name].iter_errors(doc))
    except RecursionError:
        return [_TooDeep(doc)]


class _TooDeep:
    """Stands for a schema error where the document is nested too deeply to check."""

    message = "is nested too deeply to check against the schema"
    absolute_path: tuple = ()
    absolute_schema_path: tuple = ()

    def __init__(self, instance: Any) -> None:
        self.instance = instance


def short(x: Any, limit: int = 80) -> str:
    """A bounded one-line rendering of JSON data for messages (repr of deeply nested data can fail)."""
    try:
        text = json.dumps(x, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        text = f"<{type(x).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_def(schema: str, *names: str) -> str:
    """The first of ``names`` that spec/schema/<schema> defines (a definition
    renamed by a later minor version, e.g. optimizerValues -> optimizerValues11)."""
    try:
        defs = json.loads((SCHEMA_DIR / schema).read_text(encoding="utf-8")).get("$defs", {})
    except (OSError, ValueError):
        return names[-1]
    return next((n for n in names if n in defs), names[-1])


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def ints(x: Any, lo: int, hi: int) -> bool:
    return isinstance(x, list) and all(is_int(v) and lo <= v <= hi for v in x)


