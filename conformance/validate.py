"""Validate any checkpoint against the tensorckpt format spec, without tensorckpt.

    python -m conformance.validate PATH [--json]
    tensorckpt validate PATH [--json]          (the same code)

Checks every MUST of spec/format-v1.md (and the training-state documents, see
``validate_state.py``) that can be checked from storage: the root and array
``zarr.json`` against spec/schema/*.json and section 7, canonical and
prefix-free keys, index <-> arrays, no unexpected objects, the whole chunk grid
stored, chunk sizes, shard indexes (lengths, ranges, overlaps, the empty
marker), the index CRC and every inner chunk's CRC-32C, since 1.3 the root's
checksum and every array's and chunk's digest (``validate_integrity.py``),
and completeness (section 10.4). Each violation names the spec section it breaks.

Exit status: 0 clean, 1 violations (including an incomplete checkpoint),
2 not a checkpoint, unsupported (another major version, an extension in
``must_understand``) or unreadable.

Imports only the standard library, numpy, jsonschema (optional: without it the
schema checks are skipped, with a note) and google_crc32c (optional: a pure
Python CRC-32C is used without it). Untrusted input: nothing is followed through
a symbolic link, special files are never opened, every size is checked before
anything is read, chunks are read one inner chunk (or one bounded block) at a
time, and every problem is a reported violation, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

try:
    from . import validate_base as base
    from . import validate_chunks as chunks
    from . import validate_integrity as integrity
    from . import validate_state
except ImportError:  # run as a script: python conformance/validate.py
    import validate_base as base  # type: ignore[no-redef,import-not-found]
    import validate_chunks as chunks  # type: ignore[no-redef,import-not-found]
    import validate_integrity as integrity  # type: ignore[no-redef,import-not-found]
    import validate_state  # type: ignore[no-redef,import-not-found]


DTYPES, MAX_DIM = base.DTYPES, base.MAX_DIM
is_int, key_problem, prefixes, schema_errors = base.is_int, base.key_problem, base.prefixes, base.schema_errors
ROOT_JSON_CAP = 256 << 20  # largest root zarr.json read
INNER_CHUNK_CAP = 256 << 20  # largest encoded inner chunk of an entry (section 12)
SHARD_INDEX_CAP = 64 << 20  # largest shard index of an entry (section 12)
WALK_CAP = base.WALK_CAP
SHOWN = 20  # violations shown per rule; the rest are counted
STAGING = ".tensorckpt-staging-"

# rule id -> (spec section, what the rule requires)
RULES: dict[str, tuple[str, str]] = {
    "not-committed": ("format-v1.md 10.4", "a checkpoint is committed when its root zarr.json exists; otherwise it is incomplete"),
    "root-json": ("format-v1.md 9.5", "the root zarr.json is a regular file of valid JSON (UTF-8, no BOM, no NaN/Infinity)"),
    "root-document": ("format-v1.md 9.1", "the root zarr.json is a Zarr v3 group whose attributes.tensorckpt is an object"),
    "format-version": ("format-v1.md 9.2", "format_version is a string \"MAJOR.MINOR\" without leading zeros"),
    "root-metadata": ("format-v1.md 9.2", "the members of attributes.tensorckpt have the types of 9.2"),
    "save-stats": ("format-v1.md 9.7", "save_stats has the form of 9.7"),
    "key-canonical": ("format-v1.md 5.3", "every key is a canonical flat key"),
    "key-prefix-free": ("format-v1.md 4", "no key is both a tensor and a value, and no key is a prefix path of another"),
    "tensor-entry": ("format-v1.md 9.3", "a tensor entry has a dtype of the table and valid shape, chunk_shape, inner_chunk_shape (9.5 rule 5)"),
    "value": ("format-v1.md 9.4", "a value is JSON with integers in [-2^63, 2^64 - 1]"),
    "array-missing": ("format-v1.md 4", "every tensor of the index has its array zarr.json"),
    "array-metadata": ("format-v1.md 7", "an array zarr.json is valid JSON with exactly the members and codecs of section 7"),
    "array-index": ("format-v1.md 7", "an array zarr.json agrees with its tensor entry (shape, data_type, chunk shapes, dtype)"),
    "group-missing": ("format-v1.md 4", "every proper prefix of a tensor's key is a group"),
    "group-metadata": ("format-v1.md 4", "an intermediate node's zarr.json is a Zarr v3 group"),
    "unindexed-array": ("format-v1.md 4", "every array of the store is a tensor of the index"),
    "unexpected-object": ("format-v1.md 4", "writers store no object that section 4 does not name"),
    "special-file": ("format-v1.md 12", "writers create only regular files and directories (no links, FIFOs, devices)"),
    "chunk-missing": ("format-v1.md 7", "every chunk of the grid is stored"),
    "chunk-size": ("format-v1.md 7", "a chunk object is k*e + 16n + 4 to n*e + 16n + 4 bytes long"),
    "index-crc": ("format-v1.md 7", "the shard index's CRC-32C matches"),
    "index-entry": ("format-v1.md 7", "a non-empty index entry has nbytes e and a range before the index"),
    "index-empty": ("format-v1.md 7", "an inner chunk that intersects the array is stored (not the empty marker)"),
    "index-layout": ("format-v1.md 7", "the inner chunks fill the object before the index exactly: no overlap, nothing else stored"),
    "chunk-crc": ("format-v1.md 7", "the CRC-32C of every inner chunk matches"),
    "bool-value": ("format-v1.md 6", "a bool element is one byte, 0 or 1"),
    **validate_state.RULES,
    **integrity.RULES,
}

@dataclass(frozen=True)
class Violation:
    rule: str
    where: str  # the key, or the stored object's path relative to the checkpoint
    message: str

    @property
    def section(self) -> str:
        return RULES[self.rule][0]

    def to_json(self) -> dict:
        return {"rule": self.rule, "section": self.section, "where": self.where, "message": self.message}


@dataclass
class Report:
    path: str
    status: str = "clean"  # clean, violations, incomplete, not a checkpoint, unsupported, unreadable
    format_version: str | None = None
    tensors: int = 0
    chunks: int = 0  # chunk objects whose index and inner chunks were checked
    objects: list[str] = field(default_factory=list)  # training-state objects found ("optimizer at optim")
    violations: list[Violation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _seen: set = field(default_factory=set, repr=False)
    _hidden: dict = field(default_factory=dict, repr=False)
    _shown: dict = field(default_factory=dict, repr=False)

    def add(self, rule: str, where: str, message: str) -> None:
        if (rule, where) in self._seen:
            return  # one violation per rule and place (a schema error and a code check agree)
        self._seen.add((rule, where))
        self._shown[rule] = self._shown.get(rule, 0) + 1
        if self._shown[rule] > SHOWN:
            self._hidden[rule] = self._hidden.get(rule, 0) + 1
            return
        self.violations.append(Violation(rule, where, message))

    def finish(self) -> None:
        for rule, n in self._hidden.items():
            self.violations.append(Violation(rule, "", f"... and {n} more violations of this rule"))
        self._hidden.clear()
        if self.status == "clean" and self.violations:
            self.status = "violations"

    @property
    def exit_code(self) -> int:
        if self.status in ("not a checkpoint", "unsupported", "unreadable"):
            return 2
        return 1 if self.violations or self.status != "clean" else 0

    def to_json(self) -> dict:
        return {
            "path": self.path, "status": self.status, "exit": self.exit_code, "format_version": self.format_version,
            "tensors": self.tensors, "chunks": self.chunks, "objects": self.objects,
            "violations": [v.to_json() for v in self.violations], "notes": self.notes,
        }


class Fatal(Exception):
    """Stop: ``status`` is the report's status."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------ root (section 9)


def check_root(doc: Any, report: Report) -> dict:
    """Sections 9.1, 9.2, 9.5 rules 1-6, 9.7 and the root schema. Returns the root
    metadata (possibly malformed members replaced by defaults)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("attributes"), dict) or \
            not isinstance(doc["attributes"].get("tensorckpt"), dict):
        attrs = doc.get("attributes") if isinstance(doc, dict) else None
        if isinstance(doc, dict) and doc.get("zarr_format") == 3 and (attrs is None or isinstance(attrs, dict)
                                                                       and "tensorckpt" not in attrs):
            raise Fatal("not a checkpoint", "the root zarr.json is a Zarr document without attributes.tensorckpt")
        report.add("root-document", "zarr.json", "zarr.json: not a Zarr v3 group with an object attributes.tensorckpt")
        raise Fatal("violations", "the root metadata cannot be read")
    meta = doc["attributes"]["tensorckpt"]
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        report.add("root-document", "zarr.json", "zarr.json: zarr_format must be 3 and node_type \"group\"")
    fv = meta.get("format_version")
    m = re.fullmatch(r"(0|[1-9][0-9]{0,4})\.(0|[1-9][0-9]{0,4})", fv) if isinstance(fv, str) else None
    if m is None:
        report.add("format-version", "format_version",
                   f"format_version {base.short(fv)} is not a string \"MAJOR.MINOR\"")
    else:
        report.format_version = fv
        if int(m.group(1)) != 1:
            raise Fatal("unsupported", f"format_version {fv}: this validator implements major version 1 only")
    mu = meta.get("must_understand", [])
    if isinstance(mu, list) and mu:
        raise Fatal("unsupported", f"must_understand lists {base.short(mu)}; no extension is registered in version 1 (section 13)")
    for name, ok, what in (
        ("must_understand", isinstance(mu, list) and all(isinstance(x, str) and x for x in mu), "an array of strings"),
        ("library_version", isinstance(meta.get("library_version", ""), str), "a string"),
        ("created", isinstance(meta.get("created", ""), str), "a string"),
        ("world_size", is_int(meta.get("world_size", 1)) and meta.get("world_size", 1) >= 1, "an integer >= 1"),
        ("user_metadata", isinstance(meta.get("user_metadata", {}), dict), "an object"),
        ("tensors", isinstance(meta.get("tensors"), dict), "an object (REQUIRED)"),
        ("values", isinstance(meta.get("values", {}), dict), "an object"),
    ):
        if not ok:
            report.add("root-metadata", name, f"attributes.tensorckpt.{name} must be {what}")
    if "save_stats" in meta:
        _check_save_stats(meta["save_stats"], meta.get("world_size", 1), report)
    for err in schema_errors("root-v1.schema.json", doc):
        rule, where = _root_rule(err)
        report.add(rule, where, f"root schema: {err.message} (at /{'/'.join(map(str, err.absolute_path))})")
    tensors = meta["tensors"] if isinstance(meta.get("tensors"), dict) else {}
    values = meta.get("values") if isinstance(meta.get("values"), dict) else {}
    return {"format_version": m and (int(m.group(1)), int(m.group(2))), "tensors": tensors, "values": values}


def _root_rule(err: Any) -> tuple[str, str]:
    path = list(err.absolute_path)
    if "propertyNames" in err.absolute_schema_path:
        return "key-canonical", str(err.instance)
    if path[:2] != ["attributes", "tensorckpt"] or len(path) < 3:
        return "root-document", "zarr.json"
    member = path[2]
    if member in ("tensors", "values") and len(path) > 3:
        return ("tensor-entry" if member == "tensors" else "value"), str(path[3])
    return {"format_version": "format-version", "save_stats": "save-stats"}.get(member, "root-metadata"), str(member)


def _check_save_stats(stats: Any, meta_world: Any, report: Report) -> None:
    ok = isinstance(stats, dict)
    if ok and "seconds" in stats:
        sec = stats["seconds"]
        ok = isinstance(sec, dict) and all(
            isinstance(v, list) and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 for t in v)
            for v in sec.values())
    if ok and "bytes_written" in stats:
        ok = base.ints(stats["bytes_written"], 0, 2**64)
    world = meta_world if is_int(meta_world) else None
    if ok and world is not None:
        lists = [*(stats.get("seconds") or {}).values(), *([stats["bytes_written"]] if "bytes_written" in stats else [])]
        if any(len(x) != world for x in lists):
            report.add("save-stats", "save_stats", f"save_stats: every list must have world_size ({world}) items")
    if not ok:
        report.add("save-stats", "save_stats", "save_stats: seconds must map phases to arrays of numbers >= 0 and "
                   "bytes_written be an array of integers >= 0")


def entry_problem(e: Any) -> str | None:
    """Why a tensor entry breaks 9.3 / 9.5 rule 5, or None."""
    if not isinstance(e, dict):
        return "is not an object"
    for m in ("dtype", "data_type", "shape", "chunk_shape", "inner_chunk_shape"):
        if m not in e:
            return f"lacks the REQUIRED member {m!r}"
    if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:
        return f"has dtype {base.short(e['dtype'])}, which is not in the table of section 6"
    if e["data_type"] != DTYPES[e["dtype"]][0]:
        return f"has data_type {base.short(e['data_type'])}; dtype {e['dtype']} requires {DTYPES[e['dtype']][0]!r}"
    if not base.ints(e["shape"], 0, MAX_DIM):
        return f"has shape {base.short(e['shape'])}: not a list of integers in [0, 2^62]"
    for m in ("chunk_shape", "inner_chunk_shape"):
        if not base.ints(e[m], 1, MAX_DIM):
            return f"has {m} {base.short(e[m])}: not a list of integers in [1, 2^62]"
    if not len(e["shape"]) == len(e["chunk_shape"]) == len(e["inner_chunk_shape"]) <= 32:
        return "has shape, chunk_shape and inner_chunk_shape of different lengths (or more than 32 dimensions)"
    if any(c % i for c, i in zip(e["chunk_shape"], e["inner_chunk_shape"])):
        return f"has inner_chunk_shape {e['inner_chunk_shape']} that does not divide chunk_shape {e['chunk_shape']}"
    if math.prod(e["shape"]) > MAX_DIM or math.prod(e["chunk_shape"]) > MAX_DIM:
        return "has a shape or chunk_shape whose product exceeds 2^62"
    if math.prod(e["inner_chunk_shape"]) * DTYPES[e["dtype"]][1] + 4 > INNER_CHUNK_CAP:
        return "has an encoded inner chunk larger than 256 MiB (section 12)"
    if 16 * math.prod(c // i for c, i in zip(e["chunk_shape"], e["inner_chunk_shape"])) + 4 > SHARD_INDEX_CAP:
        return "has a shard index larger than 64 MiB (section 12)"
    return None


def check_keys(tensors: dict, values: dict, report: Report) -> dict[str, dict]:
    """Sections 5.3, 4 (prefix-free), 9.3, 9.4. Returns the valid tensor entries."""
    good = {}
    for key, e in tensors.items():
        why = key_problem(key)
        if why:
            report.add("key-canonical", key, f"key {key!r} {why}")
            continue
        why = entry_problem(e)
        if why:
            report.add("tensor-entry", key, f"tensor {key!r} {why}")
            continue
        good[key] = e
    for key, v in values.items():
        why = key_problem(key)
        if why:
            report.add("key-canonical", key, f"key {key!r} {why}")
        bad = _bad_int(v)
        if bad is not None:
            report.add("value", key, f"value {key!r} holds the integer {bad}, outside [-2^63, 2^64 - 1]")
    for key in set(tensors) & set(values):
        report.add("key-prefix-free", key, f"key {key!r} is both a tensor and a value")
    keys = set(tensors) | set(values)
    for key in sorted(keys):
        for p in prefixes(key):
            if p in keys:
                report.add("key-prefix-free", key, f"key {p!r} is a prefix path of key {key!r}")
                break
    return good


def _bad_int(v: Any) -> int | None:
    stack = [v]
    while stack:
        x = stack.pop()
        if is_int(x) and not -(2**63) <= x <= 2**64 - 1:
            return x
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return None


# ------------------------------------------------------------------ the whole checkpoint


def validate(path: str | os.PathLike) -> Report:
    """Validate the checkpoint at ``path`` (a local directory, or file://...)."""
    text = os.fspath(path)
    text = text.removeprefix("file://") if text.startswith("file://") else text
    report = Report(text)
    try:
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text):  # s3://, memory://, ...: no storage client here
            raise Fatal("unsupported", f"{text}: the validator reads local directories only (it imports no storage "
                        "client): copy the checkpoint to a local directory (e.g. `aws s3 cp --recursive URL DIR`) "
                        "and validate that, or check it in place with `tensorckpt verify URL`")
        _validate(os.path.realpath(text) if os.path.isdir(text) else text, report)
    except Fatal as f:
        if f.status != "violations":
            report.status = f.status
        report.notes.append(str(f))
    except Exception as e:  # noqa: BLE001 - a validator reports, it never crashes on input
        report.status = "unreadable"
        report.notes.append(f"validator error: {type(e).__name__}: {e}")
    report.finish()
    return report


def _leftovers(root: str) -> list[str]:
    parent, name = os.path.split(root.rstrip("/"))
    try:
        return sorted(n for n in os.listdir(parent or ".") if n.startswith(f".{name}{STAGING}"))
    except OSError:
        return []


def _validate(root: str, report: Report) -> None:
    leftovers = _leftovers(root)
    if not os.path.lexists(root):
        if leftovers:
            report.status = "incomplete"
            report.add("not-committed", "", f"{root} does not exist; staging leftovers of interrupted saves: "
                       f"{', '.join(leftovers)} (format-v1.md 10.5: recover with the manager or delete with tensorckpt clean)")
            return
        raise Fatal("not a checkpoint", f"{root}: no such checkpoint (missing, section 10.4 item 3)")
    if not os.path.isdir(root):
        raise Fatal("not a checkpoint", f"{root} is not a directory")
    try:
        listing = base.walk(root)
    except OSError as e:
        raise Fatal("unreadable", f"cannot list {root}: {e.strerror}") from None
    if listing.truncated:
        report.notes.append(f"more than {WALK_CAP} entries: only the first were listed")
    if "zarr.json" not in listing.files:
        if "zarr.json" in listing.special:
            report.add("special-file", "zarr.json", f"zarr.json is {listing.special['zarr.json']}")
            return
        steps = sorted(n for n in os.listdir(root) if re.fullmatch(r"step-(?:\d{8}|[1-9]\d{8,})", n))
        if steps:
            raise Fatal("not a checkpoint", f"{root} looks like a CheckpointManager root (spec/manager.md): "
                        f"validate one of its steps, e.g. {os.path.join(root, steps[-1])}")
        report.status = "incomplete"
        what = f"{len(listing.files)} files but no root zarr.json"
        more = f"; staging leftovers: {', '.join(leftovers)}" if leftovers else ""
        report.add("not-committed", "zarr.json", f"{root} holds {what}: the checkpoint is incomplete "
                   f"(an interrupted or unfinished save){more}")
        return
    name = os.path.basename(root.rstrip("/"))
    if re.fullmatch(r"\..+\.tensorckpt-(?:staging|retired)-.*", name):
        report.notes.append(f"{name} is a staging or retired location: readers never use it in place of its target "
                            "(format-v1.md 10.4, manager.md 1)")
    if leftovers:
        report.notes.append(f"staging leftovers beside the checkpoint (they do not affect it, 10.5): {', '.join(leftovers)}")
    try:
        doc = base.read_json(root, "zarr.json", ROOT_JSON_CAP)
    except ValueError as e:
        report.add("root-json", "zarr.json", f"zarr.json {e}")
        return
    meta = check_root(doc, report)
    tensors = check_keys(meta["tensors"], meta["values"], report)
    report.tensors = len(tensors)
    for rel, what in sorted(listing.special.items()):
        report.add("special-file", rel, f"{rel} is {what}; it is not read")
    usable, stored = chunks.check_nodes(root, listing, meta["tensors"], meta["values"], tensors, report.add)
    for key in sorted(usable):
        report.chunks += chunks.check_chunks(root, key, tensors[key], stored[key], report.add, report.notes)
    raw_meta = doc.get("attributes", {}).get("tensorckpt") if isinstance(doc, dict) else None
    if isinstance(raw_meta, dict):
        with open(os.path.join(root, "zarr.json"), "rb") as f:
            raw = f.read(ROOT_JSON_CAP + 1)
        if integrity.check_root(raw, raw_meta, report.add):
            integrity.check_arrays(root, raw_meta, tensors, usable, stored, report.add)
    read = chunks.TensorReader(root, tensors, usable)
    report.objects = validate_state.check(meta["format_version"], meta["tensors"], meta["values"], report.add, read)
    if base.jsonschema is None:
        report.notes.append("jsonschema is not installed: the spec's JSON Schemas were not applied")
    if base.MISSING_SCHEMAS:
        report.notes.append(f"not found in {base.SCHEMA_DIR}, so not applied: {', '.join(sorted(base.MISSING_SCHEMAS))}")


# ------------------------------------------------------------------ command line


def render(report: Report) -> str:
    lines = [f"checkpoint  {report.path}", f"status      {report.status.upper()}"]
    if report.format_version:
        lines.append(f"format      {report.format_version}")
    lines.append(f"checked     {report.tensors} tensors, {report.chunks} chunk objects")
    if report.objects:
        lines.append(f"objects     {', '.join(report.objects)}")
    lines.append(f"violations  {len(report.violations)}")
    lines += [f"  {v.section}: {v.message}  [{v.rule}]" for v in report.violations]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(_printable(line) for line in lines)


def _printable(line: str) -> str:
    """Escape control characters (a stored file name must not drive the terminal)."""
    return line if line.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


def main(argv: list[str] | None = None, out: Any = None) -> int:
    parser = argparse.ArgumentParser(prog="validate", description="Check a checkpoint against every MUST of the "
                                     "tensorckpt format spec that storage shows (exit 0 clean, 1 violations, "
                                     "2 not a checkpoint / unsupported / unreadable).")
    parser.add_argument("path")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    out = out or sys.stdout
    report = validate(args.path)
    print(json.dumps(report.to_json(), indent=1) if args.json else render(report), file=out)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
