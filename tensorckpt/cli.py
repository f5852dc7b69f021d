"""The ``tensorckpt`` command line (also ``python -m tensorckpt``).

    tensorckpt inspect PATH [--json]   the tree of keys (shape, dtype, size),
                                       format version, completeness, and the
                                       save's phase times across ranks
    tensorckpt verify PATH [--json] [--quiet]
                                       check every metadata document and read
                                       every chunk back; exit 1 if the
                                       checkpoint is incomplete or corrupt
    tensorckpt convert SRC DST [--from FORMAT] [--to FORMAT] [--only PREFIX]
                       [--strip-prefix P] [--add-prefix P] [--dtype D]
                       [--max-shard-size 5GB] [--quiet]
                                       torch DCP / safetensors / torch.save
                                       <-> tensorckpt (tensorckpt.convert)
    tensorckpt clean PATH [--older-than SECONDS] [--dry-run] [--json]
                                       remove what interrupted saves left
                                       (spec 10.5: never a committed
                                       checkpoint, never a save in progress)
    tensorckpt list ROOT [--json]      the steps of a CheckpointManager root:
                                       step, committed or incomplete, size
    tensorckpt validate PATH [--json]  check a checkpoint against every MUST of
                                       the spec that storage shows, naming the
                                       section each violation breaks
                                       (conformance/validate.py; exit 0 clean,
                                       1 violations, 2 not a checkpoint)

Exit status: 0 success, 1 incomplete or corrupt checkpoint (inspect,
verify), 2 usage or other errors.

Storage options (``storage_options=`` of the API: endpoint, credentials,
fsspec arguments; README "Object storage") for inspect, verify, clean,
list and convert (its ``s3://`` / fsspec side): ``--storage-option KEY=VALUE`` (repeatable; ``KEY:=JSON`` for a JSON
value), over the JSON object in the environment variable
``TENSORCKPT_STORAGE_OPTIONS``, key by key: a flag wins over the variable.
The variable applies only to paths that take options (``s3://`` and fsspec
URLs); a flag given for a local path is an error. VALUE is a string
(``request_concurrency=64`` and ``anon=true`` are read as the number and
the flag those options are).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, Protocol, TextIO

from . import monitor
from .checkpoint import Checkpoint
from .clean import DEFAULT_OLDER_THAN
from .clean import clean as clean_leftovers
from .errors import IncompleteCheckpointError, TensorckptError
from .format.arrays import chunk_count
from .format.keys import split_flat_key
from .storage import commit, location
from .storage.commit_kv import REFRESH_SECONDS
from .verify import verify as verify_checkpoint


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _name(s: str) -> str:
    return s if s and s.isprintable() and s.strip() == s and "/" not in s else repr(s)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _safe(text: str) -> str:
    """``text`` with control characters (ESC, BEL, ...; from metadata or
    paths) escaped, so that nothing read from a checkpoint drives the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", text)


class Stream(Protocol):
    """Where a command prints: ``sys.stdout``, an ``io.StringIO``, any text stream."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class _SafeOut:
    """A text stream that escapes control characters in what is written."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write("\n".join(_safe(line) for line in text.split("\n")))

    def flush(self) -> None:
        self.stream.flush()


def convert(args: argparse.Namespace, out: Stream | None = None) -> int:
    """``tensorckpt convert``: :func:`tensorckpt.convert` with a progress bar."""
    from .interchange import convert as convert_checkpoint
    from .interchange.core import ImportReport

    out = out or sys.stdout
    options = {k: v for k, v in (("only", args.only), ("strip_prefix", args.strip_prefix), ("add_prefix", args.add_prefix),
                                  ("max_shard_size", args.max_shard_size), ("to_format", args.to_format)) if v}
    if args.memory_mib:
        options["memory_bytes"] = args.memory_mib << 20
    remote = args.dst if location.takes_options(location.parse(args.dst)) else args.src
    result = convert_checkpoint(args.src, args.dst, src_format=args.from_format, dtype=args.dtype,
                                progress=False if args.quiet else None,
                                storage_options=storage_options(remote, args.storage_option), **options)
    detail = f" ({result.tensors} tensors, {result.values} values, {_size(result.bytes_read)} in {result.seconds:.1f} s)" \
        if isinstance(result, ImportReport) else ""
    print(f"converted {args.src} -> {args.dst}{detail}", file=out)
    return 0


STORAGE_OPTIONS_ENV = "TENSORCKPT_STORAGE_OPTIONS"


def storage_options(path: str, flags: list[str] | None = None) -> dict[str, Any] | None:
    """The storage options of ``path``: ``TENSORCKPT_STORAGE_OPTIONS`` (a JSON
    object; only for a path that takes options), then each ``KEY=VALUE`` /
    ``KEY:=JSON`` of ``flags`` over it (module docstring). None: none."""
    out: dict[str, Any] = {}
    raw = os.environ.get(STORAGE_OPTIONS_ENV, "").strip()
    if raw and location.takes_options(location.parse(path)):
        try:
            env = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TensorckptError(f"{STORAGE_OPTIONS_ENV}: not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(env, dict):
            raise TensorckptError(f"{STORAGE_OPTIONS_ENV}: must hold a JSON object of option names to values")
        out.update(env)
    for flag in flags or ():
        key, eq, value = flag.partition("=")
        if not eq or not key.rstrip(":"):
            raise TensorckptError(f"--storage-option {key or flag!r}...: expected KEY=VALUE or KEY:=JSON")
        if key.endswith(":"):
            key = key[:-1]
            try:
                out[key] = json.loads(value)
            except ValueError:
                raise TensorckptError(f"--storage-option {key}:=...: the value is not JSON") from None
        else:
            out[key] = value
    return out or None


def inspect(path: str, as_json: bool = False, out: Stream | None = None, *,
            storage_options: Mapping[str, Any] | None = None) -> int:
    out = _SafeOut(out or sys.stdout)
    try:
        ckpt = Checkpoint(path, storage_options=storage_options)
    except IncompleteCheckpointError as e:
        print(json.dumps({"path": path, "complete": False, "error": str(e)}) if as_json else f"status: INCOMPLETE\n{e}", file=out)
        return 1
    idx = ckpt.index
    if as_json:
        doc = {"path": ckpt.path, "complete": True, **idx.to_json()}
        doc["save_phases"] = {r.phase: r.to_json() for r in monitor.summarize(idx.save_stats)}
        print(json.dumps(doc, indent=1), file=out)
        return 0
    m = ckpt.metadata
    total = sum(e.nbytes for e in idx.tensors.values())
    print(f"checkpoint  {ckpt.path}", file=out)
    print("status      committed (complete)", file=out)
    print(f"format      {m.format_version}  (written by tensorckpt {m.library_version or '?'}, {m.created or '?'}, world size {m.world_size})", file=out)
    if m.user_metadata:
        print(f"metadata    {json.dumps(m.user_metadata)[:200]}", file=out)
    print(f"contents    {len(idx.tensors)} tensors ({_size(total)}), {len(idx.values)} values", file=out)
    if m.checkpoint_id:  # format 1.3 (spec 7.1, 9.8)
        chunks = sum(chunk_count(e) for e in idx.tensors.values())
        print(f"integrity   checkpoint id {m.checkpoint_id}, root checksum verified; digests of "
              f"{len(idx.array_digests)} array documents and {chunks} chunks (checked by verify)", file=out)
    else:
        print("integrity   CRC-32C per inner chunk only (no position-bound digests before format 1.3)", file=out)
    for line in monitor.render(idx.save_stats):
        print(line, file=out)
    print(file=out)
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
            entry = idx.tensors[key]
            print(f"{label:<48} {list(entry.shape)!s:<20} {entry.dtype:<14} {_size(entry.nbytes):>10}", file=out)
        else:
            print(f"{label:<48} = {json.dumps(idx.values[key])[:80]}", file=out)
    return 0


def verify(path: str, as_json: bool = False, quiet: bool = False, out: Stream | None = None,
           err: TextIO | None = None, *, storage_options: Mapping[str, Any] | None = None) -> int:
    """Check a checkpoint completely (:func:`tensorckpt.verify`), with a
    progress bar on ``err`` when it is a terminal. Returns 0 if all is well,
    1 if the checkpoint is incomplete or corrupt."""
    out, err = out or sys.stdout, err or sys.stderr
    bar = _Progress(err) if not quiet and err.isatty() else None
    try:
        report = verify_checkpoint(path, progress=bar, storage_options=storage_options)
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        print(json.dumps(report.to_json(), indent=1), file=out)
    else:
        print(f"checkpoint  {report.path}", file=out)
        print(f"status      {report.status.upper()}", file=out)
        print(f"checked     {report.tensors} tensors, {report.chunks} chunks, {_size(report.bytes)} read back", file=out)
        print("digests     none stored (a format before 1.3: CRC-32C only)" if report.digests is None else
              f"digests     {report.digests} chunk digests match their place; array documents and root checksum too",
              file=out)
        print(f"problems    {len(report.problems)}", file=out)
        for problem in report.problems:
            print(f"  {problem.kind}: {problem.message}", file=out)
    return 0 if report.ok else 1


def clean(path: str, older_than: float = DEFAULT_OLDER_THAN, dry_run: bool = False, as_json: bool = False,
          out: Stream | None = None, *, storage_options: Mapping[str, Any] | None = None) -> int:
    """Remove the leftovers of interrupted saves to ``path`` that the rule of
    spec 10.5 allows (:func:`tensorckpt.clean`); report what went and what
    stayed, and why."""
    out = out or sys.stdout
    report = clean_leftovers(path, older_than=older_than, dry_run=dry_run, storage_options=storage_options)
    if not as_json:
        out = _SafeOut(out)
    if as_json:
        print(json.dumps(report.to_json(), indent=1), file=out)
        return 0
    state = "committed, left alone" if report.committed else "not committed"
    print(f"checkpoint  {report.path} ({state})", file=out)
    if not report.leftovers:
        print("no leftovers of interrupted saves", file=out)
    for x in report.leftovers:
        verb = ("would remove" if dry_run else "removed") if x.removed else "kept"
        print(f"  {verb:<12} {x.path}: {x.reason}", file=out)
    return 0


class _Progress:
    """A one-line progress bar: ``verify  42% [#####       ] 1.2 GiB / 2.9 GiB``."""

    WIDTH = 30

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.shown = 0.0  # when the bar was last drawn

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.shown < 0.1 and done < total:
            return
        self.shown = now
        frac = min(1.0, done / total) if total else 1.0
        fill = int(frac * self.WIDTH)
        bar = "#" * fill + " " * (self.WIDTH - fill)
        self.stream.write(f"\rverify {frac:4.0%} [{bar}] {_size(done)} / {_size(total)}")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")  # erase the bar
            self.stream.flush()


def list_steps(root: str, as_json: bool = False, out: Stream | None = None, *, storage_options: Mapping[str, Any] | None = None) -> int:
    """The steps under a :class:`tensorckpt.CheckpointManager` root."""
    from .manager import CheckpointManager

    out = out or sys.stdout
    steps = CheckpointManager(root, storage_options=storage_options).steps()  # refuses a checkpoint, a file, a FIFO (not a manager root)
    if not os.path.lexists(os.path.expanduser(root)) and "://" not in root:
        raise TensorckptError(f"{root}: no such directory (no CheckpointManager root here): check the path")
    if as_json:
        print(json.dumps([s.to_json() for s in steps], indent=1), file=out)
        return 0
    out = _SafeOut(out)
    if not steps:
        print(f"no steps under {root}", file=out)
    for s in steps:
        kept = sum(commit.REPLACED_INFIX in x for x in s.leftovers)
        parts = [f"{len(s.leftovers) - kept} leftover(s) of interrupted saves"] * (len(s.leftovers) > kept)
        parts += [f"{kept} replaced version(s) kept for readers"] * (kept > 0)
        note = f"  ({'; '.join(parts)})" if parts else ""
        print(f"{s.step:>12}  {s.status:<10} {_size(s.bytes):>10}  {s.path}{note}", file=out)
    return 0


def validate(path: str, as_json: bool = False, out: Stream | None = None) -> int:
    """``python -m conformance.validate PATH``: the validator lives in the
    conformance directory of a source checkout, and imports no tensorckpt."""
    try:
        from conformance import validate as validator
    except ImportError:
        import os

        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if not os.path.isfile(os.path.join(repo, "conformance", "validate.py")):
            print("tensorckpt: error: validate needs the conformance/ directory of a tensorckpt source checkout",
                  file=sys.stderr)
            return 2
        sys.path.insert(0, repo)
        from conformance import validate as validator
    return validator.main([path, *(["--json"] if as_json else [])], out=out)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _storage_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help=f"a storage option of an s3:// or fsspec URL (repeatable; KEY:=JSON for a JSON value); "
                   f"over {STORAGE_OPTIONS_ENV} (a JSON object)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorckpt", description="Inspect, verify and clean tensorckpt checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert", help="convert torch DCP / safetensors / torch.save checkpoints to or from tensorckpt")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--from", dest="from_format", metavar="FORMAT", help="tensorckpt, dcp, safetensors or torch (default: detected)")
    p.add_argument("--to", dest="to_format", metavar="FORMAT", help="default: tensorckpt (safetensors / torch from DST's suffix)")
    p.add_argument("--only", action="append", metavar="PREFIX", help="keep only keys starting with PREFIX (repeatable)")
    p.add_argument("--strip-prefix", metavar="P", help="remove P from the start of every key")
    p.add_argument("--add-prefix", metavar="P", help="put P before every key")
    p.add_argument("--dtype", metavar="D", help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument("--max-shard-size", metavar="SIZE", help="safetensors shard size (default 5GB)")
    p.add_argument("--memory-mib", type=int, metavar="MIB", help="bound on tensor data held in memory (default 256)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _storage_flag(p)
    p = sub.add_parser("inspect", help="print the tree, format version and completeness of a checkpoint")
    p.add_argument("path")
    _storage_flag(p)
    p.add_argument("--json", action="store_true", help="print the root index as JSON")
    p = sub.add_parser("verify", help="check all metadata and read every chunk back (exit 1 if incomplete or corrupt)")
    p.add_argument("path")
    _storage_flag(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = sub.add_parser("clean", help="remove leftovers of interrupted saves (never a committed checkpoint)")
    p.add_argument("path")
    _storage_flag(p)
    p.add_argument("--older-than", type=_seconds, default=DEFAULT_OLDER_THAN, metavar="SECONDS",
                   help=f"remove only leftovers unchanged for this long (default {DEFAULT_OLDER_THAN:g}); "
                   "it must exceed the longest a save can take (object stores: the time since the save's last "
                   f"stamp, which a running one renews every {REFRESH_SECONDS:g} s: it must exceed that plus the "
                   "clock skew)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("list", help="list the steps of a CheckpointManager root (committed or incomplete, size)")
    p.add_argument("root")
    _storage_flag(p)
    p.add_argument("--json", action="store_true", help="print the steps as JSON")
    p = sub.add_parser("validate", help="check a checkpoint against every MUST of the spec (exit 1 on a violation)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "validate":
            return validate(args.path, args.json)
        if args.command == "convert":
            return convert(args)
        so = storage_options(args.root if args.command == "list" else args.path, args.storage_option)
        if args.command == "verify":
            return verify(args.path, args.json, args.quiet, storage_options=so)
        if args.command == "clean":
            return clean(args.path, args.older_than, args.dry_run, args.json, storage_options=so)
        if args.command == "list":
            return list_steps(args.root, args.json, storage_options=so)
        return inspect(args.path, args.json, storage_options=so)
    except TensorckptError as e:
        print(_safe(f"tensorckpt: error: {e}"), file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tensorckpt inspect ... | head`: the reader is gone; stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141  # like a shell's exit status for SIGPIPE
    except OSError as e:  # not raised on purpose anywhere: still one line, never a traceback
        print(_safe(f"tensorckpt: error: {getattr(e, 'filename', None) or ''}: {e.strerror or e}"), file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
