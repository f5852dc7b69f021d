"""One reader per format version that ever differed (spec/README.md,
"Support promise"), chosen by sniffing ``format_version``.

Each module ``v<MAJOR>_<MINOR>`` is a small reader that turns the
``attributes.tensorckpt`` document of its version into the one in-memory
:class:`~tensorckpt.format.metadata.RootMetadata`; it has ``VERSION`` (a
``(major, minor)`` pair), ``read(meta, where)`` and a docstring saying what
its version changed. No other module of tensorckpt compares format versions:
a version difference is a new module here and one row of :data:`READERS`.

Selection (:func:`reader_for`): within a major version the reader of the
newest minor version at most the checkpoint's own. A checkpoint of a newer
minor version than this release knows (``1.7``) is read by the newest reader,
which ignores the members it does not know (a minor version only adds
optional members; what a reader must not ignore is listed in
``must_understand``, refused here when unknown). A newer major version, or an
older one no reader exists for, raises :class:`UnsupportedVersionError`.

Differences in the training-state layer (format 1.2's per-parameter
optimizer groups) are keys, not root members: the root reader is 1.1's, and
the optimizer adapter chooses its layout by what is stored, in one function
(:func:`tensorckpt.adapters.optimizer.optimizer_layout`).
"""

from __future__ import annotations

import re
from types import ModuleType

from ...errors import CorruptCheckpointError, UnsupportedVersionError
from ..metadata import ATTRIBUTE, RootMetadata, _obj, check_seal
from . import v1_0, v1_1, v1_2, v1_3

READERS: tuple[ModuleType, ...] = (v1_0, v1_1, v1_2, v1_3)  # oldest first; a new version appends its module
NEWEST: tuple[int, int] = READERS[-1].VERSION  # the version writers write

_VERSION = re.compile(r"(0|[1-9][0-9]{0,4})\.(0|[1-9][0-9]{0,4})")


def parse_version(version: object, where: str) -> tuple[int, int]:
    """``"MAJOR.MINOR"`` (spec 9.2: 1 to 5 digits, no leading zeros) as a pair;
    anything else is a corrupt checkpoint."""
    if not isinstance(version, str):
        raise CorruptCheckpointError(f"{where}: format_version must be a string like '1.0', got {version!r}")
    m = _VERSION.fullmatch(version)
    if m is None:
        raise CorruptCheckpointError(f"{where}: malformed format_version {version!r}")
    return int(m.group(1)), int(m.group(2))


def reader_for(version: object, where: str = "format_version") -> ModuleType:
    """The reader module for a checkpoint of ``version`` (a string as stored):
    the newest reader of the same major version whose minor is at most
    ``version``'s. Raises UnsupportedVersionError for a major version no
    reader implements, CorruptCheckpointError for a malformed version."""
    major, minor = parse_version(version, where)
    fitting = [r for r in READERS if r.VERSION[0] == major and r.VERSION[1] <= minor]
    if not fitting:
        majors = sorted({r.VERSION[0] for r in READERS})
        raise UnsupportedVersionError(
            f"{where}: format version {version} is not supported by this tensorckpt "
            f"(reads {', '.join(f'{m}.x' for m in majors)}); upgrade tensorckpt"
        )
    return fitting[-1]


def read_root(doc: object, where: str, raw: bytes | None = None) -> RootMetadata:
    """Parse an untrusted root ``zarr.json`` document (spec 9.1, 9.5): the
    Zarr group envelope, then ``attributes.tensorckpt`` by the reader its
    ``format_version`` selects. ``raw``: the document's bytes, whose
    checksum (since 1.3, spec 9.8) is checked wherever the document has one,
    whatever version it claims. Every problem raises a tensorckpt error
    naming ``where``."""
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise CorruptCheckpointError(f"{where}: not a Zarr v3 group metadata document")
    attrs = doc.get("attributes")
    if not isinstance(attrs, dict) or ATTRIBUTE not in attrs:
        raise CorruptCheckpointError(
            f"{where}: a Zarr group, but not a tensorckpt checkpoint (no attributes.{ATTRIBUTE})"
        )
    meta = _obj(attrs[ATTRIBUTE], f"{where}: attributes.{ATTRIBUTE}")
    root = reader_for(meta.get("format_version"), where).read(meta, where)  # what is malformed, named first
    if raw is not None and "checksum" in meta:
        check_seal(raw, meta["checksum"], where)
    return root
