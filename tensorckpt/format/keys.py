"""Key escaping: state-dict keys <-> Zarr node names (spec section "Keys").

A state dict is a tree of dicts. A leaf is addressed by its *key path*, the
tuple of dict keys from the root. Each key becomes one Zarr node name, escaped
so that any Python ``str`` round-trips exactly and no name is one Zarr forbids
or reserves:

1. every ``%`` becomes ``%25``, every ``/`` becomes ``%2F``, every ``\\`` becomes
   ``%5C``, and every control character (U+0000-U+001F, U+007F) becomes ``%XX``
   (two upper-case hex digits);
2. a name made only of periods (``.``, ``..``) has every period written ``%2E``;
3. a name starting with ``__`` has its first underscore written ``%5F``;
4. the name ``zarr.json`` (it would collide with the parent group's metadata
   file) is written ``zarr%2Ejson``; a name ending in ``.__lock`` (reserved by
   TensorStore's file store) has that period written ``%2E``;
5. the empty name is written ``%``  (a lone ``%`` cannot come out of rules 1-4,
   where every ``%`` is followed by two hex digits).

A key that is not valid Unicode text (a lone surrogate) cannot be stored.

Unescaping is percent-decoding, plus rule 4. The *flat key* of a leaf is its
escaped names joined with ``/``: that is the leaf's path inside the checkpoint.
"""

from __future__ import annotations

import re

from ..errors import CorruptCheckpointError, UnsupportedValueError

EMPTY = "%"
MAX_NAME_BYTES = 255  # common file-system limit on one path component
_ESCAPE_RE = re.compile(r"%([0-9A-Fa-f]{2})")
_UNSAFE_RE = re.compile(r"[%/\\\x00-\x1f\x7f]")


def escape(name: str) -> str:
    """Escape one dict key into a Zarr node name."""
    if not isinstance(name, str):
        raise UnsupportedValueError(
            f"state-dict key {name!r} is a {type(name).__name__}; keys must be str"
        )
    if name == "":
        return EMPTY
    out = _UNSAFE_RE.sub(lambda m: f"%{ord(m.group(0)):02X}", name)
    if not out.strip("."):  # only dots (no set(): this runs for every key of every save)
        out = "%2E" * len(out)
    elif out.startswith("__"):
        out = "%5F" + out[1:]
    elif out == "zarr.json":
        out = "zarr%2Ejson"
    if out.endswith(".__lock"):
        out = out[: -len(".__lock")] + "%2E__lock"
    try:
        encoded = out.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedValueError(f"state-dict key {name!r} is not valid Unicode text (lone surrogate)") from None
    if len(encoded) > MAX_NAME_BYTES:
        raise UnsupportedValueError(
            f"state-dict key {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes once escaped; "
            "shorten it (file systems limit one path component to 255 bytes)"
        )
    return out


def unescape(node: str) -> str:
    """Invert :func:`escape`. A name :func:`escape` cannot produce (not in
    canonical form) raises :class:`CorruptCheckpointError`."""
    name = "" if node == EMPTY else _ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 16)), node)
    try:
        canonical = escape(name)
    except UnsupportedValueError:
        canonical = None
    if canonical != node:
        raise CorruptCheckpointError(f"invalid escaped key component {node!r}")
    return name


def flat_key(path: tuple[str, ...]) -> str:
    """The flat key (checkpoint-relative path) of a key path."""
    return "/".join(escape(p) for p in path)


def split_flat_key(key: str) -> tuple[str, ...]:
    """Invert :func:`flat_key`, validating every component."""
    if not isinstance(key, str) or key == "" or key.startswith("/"):
        raise CorruptCheckpointError(f"invalid flat key {key!r}")
    return tuple(unescape(part) for part in key.split("/"))
