"""The validator's training-state checks (spec/training-state.md, spec/rng-and-data.md).

Nothing in a checkpoint says "this is an optimizer": the keys do. Each
``ObjectRule`` finds the object keys ``K`` its layout marks (an optimizer has
the value ``K/param_groups`` in 1.0/1.1, ``K/class`` and ``K/group_of/...`` or
``K/groups/...`` since 1.2; a sampler ``K/num_samples`` and ``K/segments``,
...) and checks the values and tensor entries under ``K`` against
spec/schema/training-state-v1.schema.json and the prose rules.

Which rules apply depends on the checkpoint's format version: ``BY_VERSION``
maps a (major, minor) to its rules, and a checkpoint gets the entry of the
newest version at most its own. A new layout in a new minor version is one new
``ObjectRule`` (or a new schema ``$defs`` name) and one new row of that table.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    from . import validate_base as base
except ImportError:  # run as a script
    import validate_base as base  # type: ignore[no-redef,import-not-found]

SCHEMA = "training-state-v1.schema.json"
MAX_WORLD = 1 << 20  # counts checked per sampler

RULES: dict[str, tuple[str, str]] = {
    "optimizer-layout": ("training-state.md 4.2", "an optimizer's keys are those of 4.2 (1.2: K/class, K/group_of/<fqn>, K/groups/<id>/<hparam>, K/state/<fqn>/<name>) or, in 1.0/1.1, of 4.4 (K/param_groups, K/state/...)"),
    "optimizer-param-groups": ("training-state.md 4.4", "each param group (1.0/1.1) has params, an array of FQNs, and no param_names"),
    "optimizer-fqn": ("training-state.md 4.1", "optimizer state is keyed by the FQNs that its param groups name (1.0/1.1)"),
    "optimizer-state-entry": ("training-state.md 4.2", "a finite real 0-d state entry is a JSON number, a 0-d bool a JSON boolean"),
    "optimizer-group-of": ("training-state.md 4.2", "every parameter with state (K/state/<fqn>) has a K/group_of/<fqn> (1.2)"),
    "optimizer-group-missing": ("training-state.md 4.2", "every id that a K/group_of/<fqn> names has its K/groups/<id> (1.2)"),
    "optimizer-group-id": ("training-state.md 4.2", "a group's id is the first 16 hex digits of the SHA-256 of its hyperparameters' canonical JSON (1.2)"),
    "optimizer-legacy-layout": ("training-state.md 4.4", "a checkpoint of format 1.2 or later stores no K/param_groups (writers MUST NOT write the 1.0/1.1 layout)"),
    "scheduler-class": ("training-state.md 5", "a scheduler's K/class (since 1.2) is its class name, a non-empty string"),
    "scheduler-pairs": ("training-state.md 5.4", "MultiStepLR's milestones (a dict with int keys) is an array of [key, value] pairs"),
    "module-tied-to": ("training-state.md 3.3", "a tied entry K/a/tied_to (since 1.2) names a non-empty tensor stored at K/<name> of the same module"),
    "sampler-layout": ("rng-and-data.md 3.3", "a sampler's values have the types of 3.3, with a count for every rank r < world"),
    "sampler-counts": ("rng-and-data.md 3.2", "a segment has one count per rank of its world, and no count exceeds its slice"),
    "rng-layout": ("rng-and-data.md 2.1", "an RNG state is the integer tensors torch, numpy, python (and cuda), one row per rank"),
    "rng-row": ("rng-and-data.md 2.2", "each numpy and python row has the form of 2.2"),
}

Add = Callable[[str, str, str], None]
Reader = Callable[[str], Any]  # flat key -> numpy array, or None when it cannot be read


@dataclass
class Obj:
    """One object found in the checkpoint: its key and what lies under it."""

    key: str  # K ('' for the top)
    values: dict[str, Any]  # rest of the flat key after 'K/' -> value
    tensors: dict[str, Any]  # rest of the flat key -> tensor entry
    add: Add
    read: Reader
    all_tensors: dict[str, Any] = field(default_factory=dict)  # the whole index's tensor entries, by flat key

    def at(self, rest: str) -> str:
        return f"{self.key}/{rest}" if self.key and rest else (rest or self.key)

    def schema(self, definition: str, doc: Any, rule: str, rule_for: Callable[[list], str] | None = None) -> None:
        for err in base.schema_errors(SCHEMA, doc, definition):
            path = list(err.absolute_path)
            r = rule_for(path) if rule_for else rule
            self.add(r, self.at(str(path[0]) if path else ""),
                     f"{self.at(str(path[0]) if path else '') or '(top)'}: {err.message} (schema $defs/{definition})")


@dataclass(frozen=True)
class ObjectRule:
    name: str
    markers: tuple[str, ...]  # value keys (or, with on_tensors, tensor keys) that all mark the object at K;
    # the first is a whole key (it locates K), the others may end in '/' (any key below it)
    check: Callable[[Obj], None]
    on_tensors: bool = False
    any_of: tuple[str, ...] = ()  # and at least one of these
    or_found_by: tuple[str, ...] = ()  # or K is found by one of these alone (ending in '/'); the check
    # then reports what is missing (an optimizer's K/group_of/... without its K/class)
    in_module: bool = False  # and K's parent (K less its last component) holds a tensor directly (a module)


def _parent(key: str) -> str:
    return key.rsplit("/", 1)[0] if "/" in key else ""


def _split(key: str, marker: str) -> str | None:
    if key == marker:
        return ""
    return key[: -len(marker) - 1] if key.endswith("/" + marker) else None


def find(rule: ObjectRule, tensors: dict, values: dict) -> list[str]:
    """The object keys K that carry every marker of ``rule`` (and one of ``any_of``).
    A marker is the rest of a key after 'K/'; one ending in '/' (``group_of/``)
    stands for any key below it."""
    where = tensors if rule.on_tensors else values
    below = {p for key in where for p in base.prefixes(key)}
    first = {k for k in (_split(key, rule.markers[0]) for key in where) if k is not None}
    more = {k for m in rule.or_found_by for k in (_split(p, m[:-1]) for p in below) if k is not None}
    if more:  # not below another K found (a parameter named group_of: K/state/group_of/...)
        every = first | more
        first |= {k for k in more if not (k and "" in every) and not any(p in every for p in base.prefixes(k))}

    def has(k: str, m: str) -> bool:
        key = f"{k}/{m}" if k else m
        return key[:-1] in below if m.endswith("/") else key in where

    if rule.in_module:
        holders = {_parent(key) for key in tensors}
        first = {k for k in first if k and _parent(k) in holders}
    return sorted(k for k in first if all(has(k, m) for m in rule.markers[1:])
                  and (not rule.any_of or any(has(k, m) for m in rule.any_of)))


def _under(d: dict, key: str) -> dict:
    if not key:
        return dict(d)
    p = key + "/"
    return {k[len(p):]: v for k, v in d.items() if k.startswith(p)}


# ------------------------------------------------------------------ optimizers (training-state.md 4)


def check_optimizer_v1(o: Obj) -> None:
    """The 1.0/1.1 layout: K/param_groups (training-state.md 4.2 of 1.1; 4.4 since 1.2)."""
    values_def = base.first_def(SCHEMA, "optimizerValues11", "optimizerValues")  # renamed when 1.2 came
    o.schema(values_def, o.values, "optimizer-layout",
             lambda path: "optimizer-param-groups" if path[:1] == ["param_groups"] else "optimizer-layout")
    o.schema("optimizerTensors", o.tensors, "optimizer-layout")
    groups = o.values.get("param_groups")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"])
            for g in groups):
        return  # reported by the schema; the names cannot be compared
    names = {p for g in groups for p in g["params"]}
    for rest in sorted({*o.values, *o.tensors}):
        parts = rest.split("/")
        if parts[0] == "state" and len(parts) >= 2:
            fqn = base.unescape(parts[1])
            if fqn not in names:
                o.add("optimizer-fqn", o.at("state/" + parts[1]),
                      f"{o.at('state/' + parts[1])}: parameter {fqn!r} has state but no param group names it")
    _state_numbers(o)


def _state_numbers(o: Obj) -> None:
    """4.2 rule 2: a finite real 0-d state entry is a JSON number (a bool a boolean), never a tensor."""
    for rest, e in sorted(o.tensors.items()):
        if rest.startswith("state/") and rest.count("/") == 2 and isinstance(e, dict) and e.get("shape") == [] and \
                e.get("dtype") not in ("complex64", "complex128"):
            x = o.read(o.at(rest))
            if x is not None and bool(np.isfinite(x.astype("float64"))):
                o.add("optimizer-state-entry", o.at(rest), f"{o.at(rest)}: a 0-d {e['dtype']} tensor holding "
                      f"{x.item()!r}; a finite number is stored as a JSON number (a bool as a JSON boolean)")


def group_id(hparams: Any) -> str | None:
    """The id of a group's hyperparameters (training-state.md 4.2): the first 16
    hex digits of the SHA-256 of Python's ``json.dumps(h, sort_keys=True,
    separators=(",", ":"))``; None when they are not JSON data."""
    try:
        text = json.dumps(hparams, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _is_id(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 16 and all(c in "0123456789abcdef" for c in x)


def _hparams(o: Obj) -> dict[str, dict]:
    """``{id: hyperparameters}`` rebuilt from the values K/groups/<id>[/<hparam>[/...]]
    (key components unescaped); ids with a tensor below them are left out."""
    out: dict[str, dict] = {}
    for rest, v in sorted(o.values.items()):
        parts = rest.split("/")
        if parts[0] != "groups" or len(parts) < 2 or not _is_id(parts[1]):
            continue
        node = out.setdefault(parts[1], {})
        names = [base.unescape(p) for p in parts[2:]]
        for name in names[:-1]:
            nxt = node.setdefault(name, {})
            if not isinstance(nxt, dict):
                break  # a prefix clash, reported by key-prefix-free
            node = nxt
        else:
            if names:
                node[names[-1]] = v
    for rest in o.tensors:
        parts = rest.split("/")
        if parts[0] == "groups" and len(parts) >= 2:
            out.pop(parts[1], None)  # a tensor hyperparameter: reported by the schema (a 0-d tensor is its number)
    return out


def check_optimizer_v1_2(o: Obj) -> None:
    """The 1.2 layout (training-state.md 4.2): K/class, K/group_of/<fqn>, K/groups/<id>/<hparam>, K/state/<fqn>/..."""
    o.schema("optimizerValues12", o.values, "optimizer-layout")
    o.schema("optimizerTensors", o.tensors, "optimizer-layout")
    group_of = {rest.split("/", 1)[1]: v for rest, v in o.values.items()
                if rest.startswith("group_of/") and rest.count("/") == 1}
    hparams = _hparams(o)
    stored_ids = {rest.split("/")[1] for rest in [*o.values, *o.tensors] if rest.startswith("groups/")}
    for fqn, gid in sorted(group_of.items()):
        if _is_id(gid) and gid not in stored_ids:
            o.add("optimizer-group-missing", o.at("group_of/" + fqn),
                  f"{o.at('group_of/' + fqn)} names the group {gid!r}, but there is no {o.at('groups/' + gid)}: the "
                  "hyperparameters of every id that group_of names are stored")
    for gid, hp in sorted(hparams.items()):
        want = group_id(hp)
        if want is not None and want != gid:
            o.add("optimizer-group-id", o.at("groups/" + gid),
                  f"{o.at('groups/' + gid)}: the id of these hyperparameters is {want!r} (the first 16 hex digits of "
                  "the SHA-256 of json.dumps(h, sort_keys=True, separators=(',', ':'))), not the stored one")
    for fqn in sorted({rest.split("/")[1] for rest in [*o.values, *o.tensors]
                       if rest.startswith("state/") and rest.count("/") >= 1}):
        if fqn not in group_of:
            o.add("optimizer-group-of", o.at("state/" + fqn),
                  f"{o.at('state/' + fqn)}: parameter {base.unescape(fqn)!r} has state but no {o.at('group_of/' + fqn)}; "
                  "every optimizer parameter has its group_of key")
    _state_numbers(o)


def check_optimizer_legacy_in_1_2(o: Obj) -> None:
    """K/param_groups in a checkpoint of format 1.2 or later: writers MUST NOT
    write the 1.0/1.1 layout (4.4). Its other rules still apply."""
    o.add("optimizer-legacy-layout", o.at("param_groups"),
          f"{o.at('param_groups')}: the 1.0/1.1 optimizer layout in a checkpoint of format 1.2 or later; writers store "
          "K/class, K/group_of/<fqn> and K/groups/<id>/<hparam> instead (training-state.md 4.2)")
    if "class" in o.values and any(rest.startswith(("group_of/", "groups/")) for rest in o.values):
        return  # both layouts: the 1.2 rule reports the rest
    check_optimizer_v1(o)


# ------------------------------------------------------------------ LR schedulers (training-state.md 5)


def check_scheduler_v1_2(o: Obj) -> None:
    """Since 1.2 a scheduler's class name is the value K/class (5.0): a string.
    A checkpoint without it is allowed (readers do not check the class then)."""
    c = o.values.get("class", "?")
    if not isinstance(c, str) or not c or base.schema_errors(SCHEMA, c, "schedulerClass"):
        o.add("scheduler-class", o.at("class"), f"{o.at('class')} is {base.short(o.values['class'])}: a scheduler's "
              "class is stored as its class name, a non-empty string (\"StepLR\")")
    check_scheduler_v1(o)


def check_scheduler_v1(o: Obj) -> None:
    m = o.values.get("milestones")
    if "milestones" in o.values and m != {}:
        ok = isinstance(m, list) and not base.schema_errors(SCHEMA, m, "schedulerPairs")
        if not ok:
            o.add("scheduler-pairs", o.at("milestones"), f"{o.at('milestones')} is {base.short(m)}: MultiStepLR's milestones "
                  "(a Counter of int keys) must be stored as an array of [key, value] arrays")


# ------------------------------------------------------------------ tied module entries (training-state.md 3.3)


def check_tied_v1_2(o: Obj) -> None:
    """K/a/tied_to = s (K a module): s is the canonical name of a non-empty
    tensor stored at K/<s>. Found (``in_module``) for every value key
    K/a/tied_to where K holds a tensor directly, as a module does, so a plain
    dict that happens to have a member tied_to is left alone."""
    parent = _parent(o.key)
    if set(o.values) != {"tied_to"} or o.tensors:
        return  # more than a tie under K/a: nested data, not a tied entry
    s = o.values["tied_to"]
    where = o.at("tied_to")
    if not isinstance(s, str) or not s or base.schema_errors(SCHEMA, s, "tiedTo"):
        o.add("module-tied-to", where, f"{where} is {base.short(s)}: a tied entry holds the canonical name of the "
              "tensor it is tied to, a non-empty string")
        return
    name = base.escape(s)
    target = f"{parent}/{name}" if parent else (name or "")
    entry = o.all_tensors.get(target) if name is not None else None
    if not isinstance(entry, dict):
        o.add("module-tied-to", where, f"{where} names {s!r}, but {target!r} is not a tensor of the same module: the "
              "first of the tied entries is stored as a tensor under the module's key, the others name it")
    elif isinstance(entry.get("shape"), list) and 0 in entry["shape"]:
        o.add("module-tied-to", where, f"{where} names {s!r}, an empty tensor (shape {entry['shape']}): empty tensors "
              "are never tied, each is stored")


# ------------------------------------------------------------------ sampler (rng-and-data.md 3)


def check_sampler_v1(o: Obj) -> None:
    o.schema("samplerValues", o.values, "sampler-layout")
    if o.tensors:
        o.add("sampler-layout", o.key, f"{o.key or '(top)'}: a sampler's members are values, but "
              f"{sorted(o.tensors)[:3]} are tensors")
    v = o.values
    for name in ("num_samples", "seed", "epoch", "world"):
        if name in v and not base.is_int(v[name]):
            o.add("sampler-layout", o.at(name), f"{o.at(name)} is {base.short(v[name])}, not an integer")
    world, n, segs = v.get("world"), v.get("num_samples"), v.get("segments")
    if not (isinstance(world, int) and base.is_int(world) and world >= 1 and isinstance(n, int) and base.is_int(n)
            and n >= 0 and isinstance(segs, list)):
        return
    counts = []
    for r in range(min(world, MAX_WORLD)):
        c = v.get(f"rank/{r}/consumed")
        if not (isinstance(c, int) and base.is_int(c) and c >= 0):
            o.add("sampler-layout", o.at(f"rank/{r}/consumed"),
                  f"{o.at(f'rank/{r}/consumed')} is {'missing' if c is None else base.short(c)}: every rank r < world "
                  f"({world}) has an integer count")
            return
        counts.append(c)
    rest = n
    for j, seg in enumerate([*segs, [world, counts]]):
        where = o.at("segments") if j < len(segs) else o.at("rank")
        if not (isinstance(seg, list) and len(seg) == 2 and base.is_int(seg[0]) and seg[0] >= 1 and
                isinstance(seg[1], list) and len(seg[1]) == seg[0] and all(base.is_int(c) and c >= 0 for c in seg[1])):
            o.add("sampler-counts", where, f"{where}: segment {j} {base.short(seg)} must be [world, [count, ...]] with one count "
                  "per rank of its world")
            return
        w, cs = seg
        for r, c in enumerate(cs):
            most = max(0, -(-(rest - r) // w))
            if c > most:
                o.add("sampler-counts", where, f"{where}: segment {j}: rank {r} consumed {c} samples, more than its "
                      f"slice of the {rest} samples left holds ({most})")
                return
        rest -= sum(cs)


# ------------------------------------------------------------------ RNG state (rng-and-data.md 2)


def check_rng_v1(o: Obj) -> None:
    o.schema("rngTensors", o.tensors, "rng-layout")
    if o.values:
        o.add("rng-layout", o.key, f"{o.key or '(top)'}: an RNG state holds only tensors, but "
              f"{sorted(o.values)[:3]} are values")
    ranks = {name: e["shape"][0] for name, e in o.tensors.items() if isinstance(e, dict) and
             isinstance(e.get("shape"), list) and len(e["shape"]) == 2 and base.is_int(e["shape"][0])}
    if len(set(ranks.values())) > 1:
        o.add("rng-layout", o.key, f"{o.key or '(top)'}: the members disagree on the number of ranks S: {ranks}")
    for name, width, check in (("python", 628, _python_row), ("numpy", 627, _numpy_row)):
        e = o.tensors.get(name)
        if not isinstance(e, dict) or e.get("dtype") != "int64" or e.get("shape", [0, 0])[1:] != [width]:
            continue
        rows = o.read(o.at(name))
        if rows is None:
            continue
        for r, row in enumerate(rows.tolist()):
            why = check(row)
            if why:
                o.add("rng-row", o.at(name), f"{o.at(name)}: row {r} {why}")
                break


def _words_ok(words: list[int]) -> bool:
    return all(0 <= w < 2**32 for w in words)


def _python_row(row: list[int]) -> str | None:
    version, words, pos, has_gauss, gauss = row[0], row[1:625], row[625], row[626], row[627]
    if version != 3:
        return f"has version {version}, not 3"
    if not _words_ok(words) or not 0 <= pos <= 624:
        return "has a state word outside [0, 2^32) or a position outside [0, 624]"
    if has_gauss not in (0, 1) or (has_gauss == 0 and gauss != 0):
        return f"has has_gauss {has_gauss} with gauss {gauss} (has_gauss is 0 or 1; gauss is 0 without one)"
    return None


def _numpy_row(row: list[int]) -> str | None:
    if not _words_ok(row[:624]) or not 0 <= row[624] <= 624:
        return "has a key outside [0, 2^32) or a position outside [0, 624]"
    if row[625] not in (0, 1):
        return f"has has_gauss {row[625]}, not 0 or 1"
    return None


# ------------------------------------------------------------------ rules per format version

OPTIMIZER_V1 = ObjectRule("optimizer", ("param_groups",), check_optimizer_v1)
SCHEDULER_V1 = ObjectRule("lr scheduler", ("base_lrs", "last_epoch"), check_scheduler_v1)
SAMPLER_V1 = ObjectRule("sampler", ("num_samples", "segments", "version"), check_sampler_v1)
RNG_V1 = ObjectRule("rng state", ("torch",), check_rng_v1, on_tensors=True, any_of=("numpy", "python"))
# 1.2: optimizers by K/class with K/group_of/..., K/groups/... or K/state/... (one without parameters, only
# K/class, has nothing else to check), or by K/group_of/... or K/groups/... alone (then K/class is missing);
# K/param_groups is still found, to be reported (4.4)
OPTIMIZER_V1_2 = ObjectRule("optimizer", ("class",), check_optimizer_v1_2, any_of=("group_of/", "groups/", "state/"),
                            or_found_by=("group_of/", "groups/"))
LEGACY_OPTIMIZER_V1_2 = ObjectRule("optimizer (1.0/1.1 layout)", ("param_groups",), check_optimizer_legacy_in_1_2)
SCHEDULER_V1_2 = ObjectRule("lr scheduler", ("base_lrs", "last_epoch"), check_scheduler_v1_2)
TIED_V1_2 = ObjectRule("tied entry", ("tied_to",), check_tied_v1_2, in_module=True)

BY_VERSION: dict[tuple[int, int], tuple[ObjectRule, ...]] = {
    (1, 0): (OPTIMIZER_V1, SCHEDULER_V1, SAMPLER_V1, RNG_V1),
    (1, 2): (OPTIMIZER_V1_2, LEGACY_OPTIMIZER_V1_2, SCHEDULER_V1_2, SAMPLER_V1, RNG_V1, TIED_V1_2),
}


def rules_for(version: tuple[int, int] | None) -> tuple[ObjectRule, ...]:
    """The rules of the newest version at most ``version`` (the newest known one
    when the version is unknown or malformed)."""
    known = sorted(BY_VERSION)
    fitting = [v for v in known if version is None or v <= version]
    return BY_VERSION[(fitting or known)[-1]]


def check(version: tuple[int, int] | None, tensors: dict, values: dict, add: Add, read: Reader) -> list[str]:
    """Check every object the keys mark; returns 'name at K' for each found."""
    found = []
    for rule in rules_for(version):
        for key in find(rule, tensors, values):
            found.append(f"{rule.name} at {key or '(top)'}")
            rule.check(Obj(key, _under(values, key), _under(tensors, key), add, read, tensors))
    return found
