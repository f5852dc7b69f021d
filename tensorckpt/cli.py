"""The ``tensorckpt`` command line (also ``python -m tensorckpt``).

    tensorckpt inspect PATH [--json]   the tree of keys (shape, dtype, size),
                                       format version and completeness
"""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import Checkpoint
from .errors import IncompleteCheckpointError, TensorckptError
from .format.keys import split_flat_key


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _name(s: str) -> str:
    return s if s and s.isprintable() and s.strip() == s and "/" not in s else repr(s)


def inspect(path: str, as_json: bool = False, out=None) -> int:
    out = out or sys.stdout
    try:
        ckpt = Checkpoint(path)
    except IncompleteCheckpointError as e:
        print(json.dumps({"path": path, "complete": False, "error": str(e)}) if as_json else f"status: INCOMPLETE\n{e}", file=out)
        return 1
    idx = ckpt.index
    if as_json:
        doc = {"path": ckpt.path, "complete": True, **idx.to_json()}
        print(json.dumps(doc, indent=1), file=out)
        return 0
    m = ckpt.metadata
    total = sum(e.nbytes for e in idx.tensors.values())
    print(f"checkpoint  {ckpt.path}", file=out)
    print("status      committed (complete)", file=out)
    print(f"format      {m.format_version}  (written by tensorckpt {m.library_version or '?'}, {m.created or '?'}, world size {m.world_size})", file=out)
    if m.user_metadata:
        print(f"metadata    {json.dumps(m.user_metadata)[:200]}", file=out)
    print(f"contents    {len(idx.tensors)} tensors ({_size(total)}), {len(idx.values)} values\n", file=out)
    shown: set[tuple[str, ...]] = set()
    for key in sorted([*idx.tensors, *idx.values], key=split_flat_key):
        path_ = split_flat_key(key)
        for depth in range(len(path_) - 1):
            if path_[: depth + 1] not in shown:
                shown.add(path_[: depth + 1])
                print("  " * depth + _name(path_[depth]) + "/", file=out)
        pad = "  " * (len(path_) - 1)
        label = pad + _name(path_[-1])
        if key in idx.tensors:
            e = idx.tensors[key]
            print(f"{label:<48} {str(list(e.shape)):<20} {e.dtype:<14} {_size(e.nbytes):>10}", file=out)
        else:
            print(f"{label:<48} = {json.dumps(idx.values[key])[:80]}", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorckpt", description="Inspect tensorckpt checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print the tree, format version and completeness of a checkpoint")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the root index as JSON")
    args = parser.parse_args(argv)
    try:
        return inspect(args.path, args.json)
    except TensorckptError as e:
        print(f"tensorckpt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
