"""Write the broken variants of the goldens (conformance/golden/broken/<name>/).

Each variant is a committed golden (golden/v1/<source>/checkpoint) copied,
optionally cut down to the keys under a few prefixes, and then broken in exactly
one way. Its ``expected.json`` names the one rule of ``conformance/validate.py``
(and the spec section) that the validator must report, and nothing else:

    {"source": "sharded", "rule": "chunk-crc", "section": "format-v1.md 7",
     "exit": 1, "description": "..."}

    python conformance/make_broken.py [NAME ...] [--force] [--out DIR]

Like make_golden.py it refuses to overwrite a committed variant unless --force.
Deterministic: ``test_validate.py`` rebuilds every variant into a temporary
directory and compares it with the committed one byte for byte. Standard library
and conformance.validate_base only (never tensorckpt).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conformance import validate
from conformance.validate_base import crc32c

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "v1"
BROKEN = HERE / "golden" / "broken"


# ------------------------------------------------------------------ helpers


def _root(ck: Path) -> dict:
    return json.loads((ck / "zarr.json").read_bytes())


def _write_root(ck: Path, doc: dict) -> None:
    (ck / "zarr.json").write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n", encoding="utf-8")


def _meta_edit(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def run(ck: Path) -> None:
        doc = _root(ck)
        edit(doc["attributes"]["tensorckpt"])
        _write_root(ck, doc)
    return run


def _index(data: bytes, n: int) -> list[list[int]]:
    body = data[-(16 * n + 4):-4]
    return [list(struct.unpack_from("<QQ", body, 16 * j)) for j in range(n)]


def _with_index(data: bytes, entries: list[list[int]]) -> bytes:
    body = b"".join(struct.pack("<QQ", o, nb) for o, nb in entries)
    return data[: -(len(body) + 4)] + body + struct.pack("<I", crc32c(body))


def _edit_object(rel: str, edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def run(ck: Path) -> None:
        p = ck / rel
        p.write_bytes(edit(p.read_bytes()))
    return run


def _flip(at: int) -> Callable[[bytes], bytes]:
    def run(data: bytes) -> bytes:
        b = bytearray(data)
        b[at] ^= 0x01
        return bytes(b)
    return run


def _set_int64(rel: str, element: int) -> Callable[[Path], None]:
    """Set one int64 element of a one-chunk, one-inner-chunk array to 4 and fix its CRC."""
    def run(ck: Path) -> None:
        p = ck / rel
        b = bytearray(p.read_bytes())
        off, nb = _index(bytes(b), 1)[0]
        struct.pack_into("<q", b, off + 8 * element, 4)
        struct.pack_into("<I", b, off + nb - 4, crc32c(bytes(b[off:off + nb - 4])))
        p.write_bytes(bytes(b))
    return run


def _swap(x: str, y: str) -> Callable[[Path], None]:
    """Swap two stored objects (or directories): each stays intact."""
    def run(ck: Path) -> None:
        tmp = ck / ".swap"
        (ck / x).rename(tmp)
        (ck / y).rename(ck / x)
        tmp.rename(ck / y)
    return run


def _flip_root_byte(find: bytes, bit: int) -> Callable[[Path], None]:
    """Flip one bit of the root document's first byte after ``find``, in place (no reformatting)."""
    def run(ck: Path) -> None:
        b = bytearray((ck / "zarr.json").read_bytes())
        b[b.index(find) + len(find)] ^= 1 << bit
        (ck / "zarr.json").write_bytes(bytes(b))
    return run


def _drop_count(ck: Path) -> None:
    _meta_edit(lambda m: m["values"].pop("data/rank/0/consumed"))(ck)
    shutil.rmtree(ck / "data" / "rank")


def _drop_params(meta: dict) -> None:
    del meta["values"]["optim/param_groups"][0]["params"]


def _rename_group(meta: dict) -> None:
    """Move the one group of optim (1.2) to the id 0123456789abcdef, group_of following it."""
    values, new = meta["values"], "0123456789abcdef"
    for k in [k for k in values if k.startswith("optim/groups/")]:
        parts = k.split("/")
        values["/".join([*parts[:2], new, *parts[3:]])] = values.pop(k)
    for k in [k for k in values if k.startswith("optim/group_of/")]:
        values[k] = new
    meta["values"] = dict(sorted(values.items()))


def _move_group(ck: Path) -> None:
    old = next(k.split("/")[2] for k in _root(ck)["attributes"]["tensorckpt"]["values"] if k.startswith("optim/groups/"))
    _meta_edit(_rename_group)(ck)
    if (ck / "optim" / "groups" / old).is_dir():  # the group node of the value-only prefix
        (ck / "optim" / "groups" / old).rename(ck / "optim" / "groups" / "0123456789abcdef")


def _group_of_elsewhere(meta: dict) -> None:
    meta["values"]["optim/group_of/0.bias"] = "0123456789abcdef"


# ------------------------------------------------------------------ the variants


@dataclass(frozen=True)
class Variant:
    source: str  # golden under golden/v1/
    rule: str  # the one rule validate.py must report
    description: str
    breaks: Callable[[Path], object]
    keep: tuple[str, ...] = ()  # cut the copy down to the keys under these prefixes (empty: keep all)


VARIANTS: dict[str, Variant] = {v_name: v for v_name, v in {
    "flipped_data_bit": Variant("sharded", "chunk-crc", "one bit of the first inner chunk's data of rows/c/0/0 flipped",
                                _edit_object("rows/c/0/0", _flip(0))),
    "bad_chunk_crc": Variant("sharded", "chunk-crc", "the CRC-32C of rows/c/0/0's first inner chunk altered",
                             _edit_object("rows/c/0/0", _flip(33))),
    "bad_index_crc": Variant("sharded", "index-crc", "the CRC-32C of rows/c/0/0's shard index altered",
                             _edit_object("rows/c/0/0", _flip(107))),
    "truncated_chunk": Variant("sharded", "chunk-size", "rows/c/1/0 cut from 108 to 100 bytes",
                               _edit_object("rows/c/1/0", lambda d: d[:100])),
    "missing_chunk": Variant("sharded", "chunk-missing", "vec/c/2 deleted", lambda ck: (ck / "vec" / "c" / "2").unlink()),
    "overlapping_index_entries": Variant(
        "sharded", "index-layout", "rows/c/2/0: both index entries point at the first inner chunk (index CRC fixed)",
        _edit_object("rows/c/2/0", lambda d: _with_index(d, [_index(d, 2)[0], _index(d, 2)[0]]))),
    "empty_index_entry": Variant(
        "sharded", "index-empty", "rows/c/3/0: the second inner chunk's entry is the empty marker (index CRC fixed)",
        _edit_object("rows/c/3/0", lambda d: _with_index(d, [_index(d, 2)[0], [2**64 - 1, 2**64 - 1]]))),
    "wrong_index_nbytes": Variant(
        "sharded", "index-entry", "vec/c/1: an index entry with nbytes 35 instead of 36 (index CRC fixed)",
        _edit_object("vec/c/1", lambda d: _with_index(d, [[o, nb - 1] if j == 0 else [o, nb]
                                                           for j, (o, nb) in enumerate(_index(d, 2))]))),
    "extra_unknown_array": Variant("sharded", "unindexed-array", "a copy of the array vec stored as stray/, not in the index",
                                   lambda ck: shutil.copytree(ck / "vec", ck / "stray")),
    "unexpected_object": Variant("sharded", "unexpected-object", "a stray file notes.txt at the top",
                                 lambda ck: (ck / "notes.txt").write_text("not part of a checkpoint\n")),
    "non_canonical_key": Variant("basic", "key-canonical", "the value key cfg/betas renamed cfg/%62etas ('b' escaped)",
                                 _meta_edit(lambda m: m["values"].__setitem__("cfg/%62etas", m["values"].pop("cfg/betas")))),
    "prefix_clash_keys": Variant("basic", "key-prefix-free", "a value model/encoder beside the tensor model/encoder/layer0/weight",
                                 _meta_edit(lambda m: m["values"].__setitem__("model/encoder", 1))),
    "root_schema_format_version": Variant("basic", "format-version", "format_version is the number 1.0, not a string",
                                          _meta_edit(lambda m: m.__setitem__("format_version", 1.0))),
    "array_shape_mismatch": Variant(
        "basic", "array-index", "weight/zarr.json says shape [4, 4]; the root index says [3, 4]",
        _edit_object("weight/zarr.json", lambda d: json.dumps({**json.loads(d), "shape": [4, 4]}).encode())),
    "missing_array": Variant("basic", "array-missing", "scalar/zarr.json deleted (its chunk stays)",
                             lambda ck: (ck / "scalar" / "zarr.json").unlink()),
    "missing_group": Variant("basic", "group-missing", "model/encoder/zarr.json deleted",
                             lambda ck: (ck / "model" / "encoder" / "zarr.json").unlink()),
    "missing_root": Variant("basic", "not-committed", "the root zarr.json deleted: an incomplete checkpoint",
                            lambda ck: (ck / "zarr.json").unlink()),
    "param_groups_without_params": Variant("training_state", "optimizer-param-groups",
                                           "optim/param_groups[0] has no member params", _meta_edit(_drop_params),
                                           keep=("optim",)),
    "sampler_count_missing": Variant("training_state", "sampler-layout",
                                     "data/rank/0/consumed deleted (world is 1), and the groups data/rank/...",
                                     _drop_count, keep=("data",)),
    "rng_python_version": Variant("training_state", "rng-row", "row 0 of rng/python has version 4, not 3 (CRC fixed)",
                                  _set_int64("rng/python/c/0/0", 0), keep=("rng",)),
    "wrong_group_id": Variant("training_state_1_2", "optimizer-group-id",
                              "optim's group (1.2) stored under the id 0123456789abcdef (group_of following), not the "
                              "digest of its hyperparameters", _move_group, keep=("optim",)),
    "group_of_missing_group": Variant("training_state_1_2", "optimizer-group-missing",
                                      "optim/group_of/0.bias names the group 0123456789abcdef, which is not stored",
                                      _meta_edit(_group_of_elsewhere), keep=("optim",)),
    "swapped_chunks_1_3": Variant("integrity_1_3", "chunk-digest",
                                  "a/c/1/0 and b/c/1/0 swapped (each intact, in the other tensor's place)",
                                  _swap("a/c/1/0", "b/c/1/0")),
    "swapped_inner_chunks_1_3": Variant(
        "integrity_1_3", "chunk-digest", "a/c/0/0: its two index entries swapped (index CRC fixed): inner chunks reordered",
        _edit_object("a/c/0/0", lambda d: _with_index(d, list(reversed(_index(d, 2)))))),
    "swapped_arrays_1_3": Variant("integrity_1_3", "array-digest", "the array directories a and b swapped",
                                  _swap("a", "b")),
    "flipped_root_value_1_3": Variant("integrity_1_3", "root-checksum",
                                      "one bit of the root's value optim/lr flipped in place: 0.001 becomes 1.001",
                                      _flip_root_byte(b'"optim/lr": ', 0)),
}.items()}


def _cut(ck: Path, keep: tuple[str, ...]) -> None:
    """Remove every key not under ``keep``, from the index and from storage."""
    doc = _root(ck)
    meta = doc["attributes"]["tensorckpt"]

    def kept(k: str) -> bool:
        return any(k == p or k.startswith(p + "/") for p in keep)

    meta["tensors"] = {k: v for k, v in meta["tensors"].items() if kept(k)}
    meta["values"] = {k: v for k, v in meta["values"].items() if kept(k)}
    for child in sorted(ck.iterdir()):
        if child.name != "zarr.json" and child.name not in keep:
            shutil.rmtree(child)
    _write_root(ck, doc)


def make(name: str, out: Path) -> Path:
    v = VARIANTS[name]
    target = out / name
    if target.exists():
        shutil.rmtree(target)
    ck = target / "checkpoint"
    shutil.copytree(GOLDEN / v.source / "checkpoint", ck)
    if v.keep:
        _cut(ck, v.keep)
    v.breaks(ck)
    expected = {"source": v.source, "rule": v.rule, "section": validate.RULES[v.rule][0], "exit": 1,
                "description": v.description}
    (target / "expected.json").write_text(json.dumps(expected, indent=1) + "\n", encoding="utf-8")
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help=f"variants to write (default: all): {', '.join(VARIANTS)}")
    p.add_argument("--force", action="store_true", help="overwrite committed variants")
    p.add_argument("--out", type=Path, default=BROKEN)
    args = p.parse_args(argv)
    names = args.names or list(VARIANTS)
    for name in names:
        if name not in VARIANTS:
            p.error(f"unknown variant {name!r}")
        if (args.out / name).exists() and not args.force:
            print(f"{args.out / name} exists; pass --force to rewrite it", file=sys.stderr)
            return 1
    for name in names:
        print(make(name, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
