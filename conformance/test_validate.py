"""conformance/validate.py: clean on every golden and on fresh tensorckpt
checkpoints; on every broken variant (golden/broken/<name>/) it reports exactly
the rule its expected.json names; untrusted input (links, FIFOs, sparse huge
chunks, garbage JSON) is reported, never followed, read whole or raised; and it
runs without tensorckpt."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tensorckpt
from conformance import make_broken, validate
from tests.forge import reseal

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GOLDENS = sorted(p.parent for p in (HERE / "golden" / "v1").glob("*/expected.json"))
BROKEN = sorted(p.parent for p in (HERE / "golden" / "broken").glob("*/expected.json"))


def _rules(report: validate.Report) -> set[str]:
    return {v.rule for v in report.violations}


def _clean(path) -> validate.Report:
    report = validate.validate(path)
    assert (report.exit_code, report.violations, report.status) == (0, [], "clean"), validate.render(report)
    return report


@pytest.mark.parametrize("golden", GOLDENS, ids=lambda p: p.name)
def test_goldens_are_clean(golden):
    expected = json.loads((golden / "expected.json").read_text())
    report = _clean(golden / expected["checkpoint"])
    assert report.tensors == len(expected["tensors"])


def test_training_state_golden_objects_are_found():
    report = _clean(HERE / "golden" / "v1" / "training_state" / "checkpoint")
    assert report.objects == ["optimizer at optim", "lr scheduler at sched", "sampler at data", "rng state at rng"]


@pytest.mark.parametrize("variant", BROKEN, ids=lambda p: p.name)
def test_broken_variant_reports_exactly_its_rule(variant):
    expected = json.loads((variant / "expected.json").read_text())
    report = validate.validate(variant / "checkpoint")
    assert report.exit_code == expected["exit"]
    assert _rules(report) == {expected["rule"]}, validate.render(report)
    assert {v.section for v in report.violations} == {expected["section"]}
    assert f"{expected['section']}: " in validate.render(report)


def test_the_required_broken_variants_exist():
    names = {p.name for p in BROKEN}
    assert {"flipped_data_bit", "bad_chunk_crc", "bad_index_crc", "truncated_chunk", "missing_chunk",
            "overlapping_index_entries", "extra_unknown_array", "non_canonical_key", "prefix_clash_keys",
            "root_schema_format_version", "array_shape_mismatch", "param_groups_without_params",
            "missing_root"} <= names
    assert names == set(make_broken.VARIANTS)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_make_broken_rebuilds_the_committed_variants(tmp_path):
    assert make_broken.main(["--out", str(tmp_path)]) == 0
    for variant in BROKEN:
        assert _tree(tmp_path / variant.name) == _tree(variant), variant.name
    assert make_broken.main(["--out", str(tmp_path), "missing_root"]) == 1  # refuses to overwrite


# ------------------------------------------------------------------ fresh checkpoints


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(37, 5, generator=g), "b": torch.zeros(5, dtype=torch.bfloat16),
                  "__init__": torch.ones(2, dtype=torch.float8_e4m3fn)},
        "flags": torch.tensor([True, False, True]),
        "z": torch.randn(3, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
        "": {"..": torch.arange(7), "a/b": 3},
        "step": 3,
    }


@pytest.mark.parametrize("options", [{}, {"shard_bytes": 128, "inner_chunk_bytes": 32}], ids=["default", "small"])
def test_fresh_plain_checkpoint_is_clean(tmp_path, options):
    tensorckpt.save(_state(), tmp_path / "ck", **options)
    report = _clean(tmp_path / "ck")
    assert report.tensors == 8 and report.chunks >= 7


def test_fresh_sharded_tensor_checkpoint_is_clean(tmp_path):
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    tensorckpt.save({"rows": tensorckpt.ShardedTensor(full, (10, 6), (0, 0)), "step": 1}, tmp_path / "ck",
                    shard_bytes=64, inner_chunk_bytes=16)
    _clean(tmp_path / "ck")


def _save_rows(rank: int, world: int, path: str) -> None:
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    lo, hi = [(0, 4), (4, 7), (7, 10)][rank]  # np.array_split rows: chunks straddle the boxes
    tensorckpt.save({"rows": tensorckpt.ShardedTensor(full[lo:hi].clone(), (10, 6), (lo, 0)), "rep": full[:2]}, path,
                    inner_chunk_bytes=24)


@pytest.mark.skipif(not os.environ.get("TENSORCKPT_VALIDATE_DIST"), reason="set TENSORCKPT_VALIDATE_DIST=1 (3 gloo ranks)")
def test_fresh_distributed_checkpoint_is_clean(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    import dist

    dist.run(3, _save_rows, str(tmp_path / "ck"), timeout=120)
    _clean(tmp_path / "ck")


def test_fresh_training_state_is_clean(tmp_path):
    from conformance.make_golden import training_objects

    tensorckpt.save(training_objects(), tmp_path / "ck")
    report = _clean(tmp_path / "ck")
    assert len(report.objects) == 4


# ------------------------------------------------------------------ untrusted input


@pytest.fixture
def sharded(tmp_path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(HERE / "golden" / "v1" / "sharded" / "checkpoint", ck)
    return ck


def test_symlinked_chunk_is_reported_not_followed(sharded, tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes((sharded / "vec" / "c" / "3").read_bytes())
    (sharded / "vec" / "c" / "3").unlink()
    (sharded / "vec" / "c" / "3").symlink_to(outside)
    (sharded / "rows" / "c" / "3").rename(tmp_path / "rows3")
    (sharded / "rows" / "c" / "3").symlink_to(tmp_path, target_is_directory=True)  # a directory link
    report = validate.validate(sharded)
    assert {v.where for v in report.violations if v.rule == "special-file"} == {"vec/c/3", "rows/c/3"}
    # the linked file sits where a chunk belongs; the linked directory hides chunk c/3/0, which is missing
    assert [v.where for v in report.violations if v.rule != "special-file"] == ["rows/c/3/0"]
    assert report.exit_code == 1


def test_fifo_is_never_opened(sharded):
    (sharded / "vec" / "c" / "3").unlink()
    os.mkfifo(sharded / "vec" / "c" / "3")
    report = validate.validate(sharded)  # opening it would block forever
    assert _rules(report) == {"special-file"}


def test_sparse_huge_chunk_is_not_read(sharded):
    with open(sharded / "vec" / "c" / "0", "r+b") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse: reading it would exhaust memory
    report = validate.validate(sharded)
    assert _rules(report) == {"chunk-size"} and "more than" in report.violations[0].message


def test_forged_grid_is_reported_without_enumerating_it(sharded):
    doc = json.loads((sharded / "zarr.json").read_bytes())
    doc["attributes"]["tensorckpt"]["tensors"]["vec"].update(shape=[2**40], chunk_shape=[8], inner_chunk_shape=[4])
    (sharded / "zarr.json").write_text(json.dumps(doc))
    arr = json.loads((sharded / "vec" / "zarr.json").read_bytes())
    arr["shape"] = [2**40]
    (sharded / "vec" / "zarr.json").write_text(json.dumps(arr))
    report = validate.validate(sharded)
    assert _rules(report) == {"chunk-missing"} and "137438953468 of 137438953472" in report.violations[0].message


@pytest.mark.parametrize("data, rule", [
    (b"{not json", "root-json"),
    (b'{"zarr_format": 3, "node_type": "group", "attributes": {"tensorckpt": {"format_version": NaN}}}', "root-json"),
    (b"\xef\xbb\xbf{}", "root-json"),
    (b"[" * 100000 + b"]" * 100000, "root-json"),
    (b"[1, 2]", "root-document"),
])
def test_garbage_root_is_a_violation_not_a_traceback(sharded, data, rule):
    (sharded / "zarr.json").write_bytes(data)
    report = validate.validate(sharded)
    assert _rules(report) == {rule} and report.exit_code == 1


@pytest.mark.parametrize("edit, rule", [
    (lambda m: m["tensors"]["vec"].update(inner_chunk_shape=[3]), "tensor-entry"),  # does not divide 8
    (lambda m: m["tensors"]["vec"].update(shape=[30.0]), "tensor-entry"),  # 30.0 is not an integer
    (lambda m: m["tensors"]["vec"].update(data_type="float32"), "tensor-entry"),
    (lambda m: m["tensors"]["vec"].update(chunk_shape=[2**38], inner_chunk_shape=[2**38]), "tensor-entry"),  # 12: 1 TiB+
    (lambda m: m["tensors"]["vec"].update(chunk_shape=[2**23], inner_chunk_shape=[1]), "tensor-entry"),  # 128 MiB index
    (lambda m: m["values"].update({"x": 2**64}), "value"),
    (lambda m: m.update(world_size=0), "root-metadata"),
    (lambda m: m.update(save_stats={"seconds": {"plan": [-1]}}), "save-stats"),
    (lambda m: m.update(save_stats={"seconds": {"plan": [1.0, 2.0]}, "bytes_written": [1, 2]}), "save-stats"),
])
def test_root_index_rules(sharded, edit, rule):
    doc = json.loads((sharded / "zarr.json").read_bytes())
    edit(doc["attributes"]["tensorckpt"])
    (sharded / "zarr.json").write_text(json.dumps(doc))
    report = validate.validate(sharded)
    assert rule in _rules(report) and _rules(report) <= {rule, "unexpected-object"}, validate.render(report)


def test_array_codec_chain_without_crc_is_rejected(sharded):
    arr = json.loads((sharded / "vec" / "zarr.json").read_bytes())
    arr["codecs"][0]["configuration"]["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    (sharded / "vec" / "zarr.json").write_text(json.dumps(arr))
    assert _rules(validate.validate(sharded)) == {"array-metadata"}


def test_bool_bytes_other_than_0_and_1(tmp_path):
    tensorckpt.save({"f": torch.tensor([True, False])}, tmp_path / "ck")
    p = tmp_path / "ck" / "f" / "c" / "0"
    data = bytearray(p.read_bytes())
    data[1] = 2
    data[2:6] = validate.base.crc32c(bytes(data[:2])).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    reseal(tmp_path / "ck")  # its chunk digest too (format 1.3): only the bool byte is wrong
    assert _rules(validate.validate(tmp_path / "ck")) == {"bool-value"}


def test_exit_2_for_what_is_not_a_checkpoint(tmp_path):
    assert validate.validate(tmp_path / "nothing").exit_code == 2
    (tmp_path / "file").write_text("x")
    assert validate.validate(tmp_path / "file").exit_code == 2
    (tmp_path / "zarr" / "zarr.json").parent.mkdir()
    (tmp_path / "zarr" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    assert validate.validate(tmp_path / "zarr").status == "not a checkpoint"


def test_incomplete_names_staging_leftovers(tmp_path):
    (tmp_path / ".ck.tensorckpt-staging-0123456789ab").mkdir()
    report = validate.validate(tmp_path / "ck")
    assert report.exit_code == 1 and _rules(report) == {"not-committed"}
    assert "tensorckpt-staging-0123456789ab" in report.violations[0].message


def test_sampler_count_beyond_its_slice(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(HERE / "golden" / "v1" / "training_state" / "checkpoint", ck)
    doc = json.loads((ck / "zarr.json").read_bytes())
    doc["attributes"]["tensorckpt"]["values"]["data/rank/0/consumed"] = 11  # 10 samples
    (ck / "zarr.json").write_text(json.dumps(doc))
    assert _rules(validate.validate(ck)) == {"sampler-counts"}


# ------------------------------------------------------------------ command lines, no tensorckpt


def test_cli_and_module_without_tensorckpt(tmp_path):
    variant = HERE / "golden" / "broken" / "bad_index_crc" / "checkpoint"
    code = ("import sys, runpy; sys.argv = ['validate', sys.argv[1], '--json'];"
            "import numpy, json; [__import__(m) for m in ('google_crc32c', 'jsonschema')];"
            "before = set(sys.modules);"
            "rc = 0\ntry:\n runpy.run_module('conformance.validate', run_name='__main__')\n"
            "except SystemExit as e:\n rc = e.code\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('tensorckpt', 'torch', 'tensorstore', 'zarr')]\n"
            "sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, str(variant)], capture_output=True, text=True, env=env, check=False,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 1, out.stderr
    assert json.loads(out.stdout)["violations"][0]["section"] == "format-v1.md 7"
    script = subprocess.run([sys.executable, str(HERE / "validate.py"), str(variant)], capture_output=True, text=True, check=False,
                            env={**os.environ, "PYTHONPATH": ""}, cwd=tmp_path, timeout=60)
    assert script.returncode == 1 and "format-v1.md 7: " in script.stdout, script.stderr


def test_tensorckpt_validate_command(capsys):
    from tensorckpt import cli

    assert cli.main(["validate", str(GOLDENS[0] / "checkpoint")]) == 0
    assert "CLEAN" in capsys.readouterr().out
    assert cli.main(["validate", str(HERE / "golden" / "broken" / "missing_chunk" / "checkpoint"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["violations"][0]["rule"] == "chunk-missing"


def test_numpy_only_reader_agrees_with_tensorckpt():
    """TensorReader (used for the RNG rows) reads what tensorckpt reads."""
    ck = HERE / "golden" / "v1" / "training_state" / "checkpoint"
    report = validate.validate(ck)
    assert report.exit_code == 0
    doc = json.loads((ck / "zarr.json").read_bytes())["attributes"]["tensorckpt"]["tensors"]
    read = validate.chunks.TensorReader(str(ck), doc, set(doc))
    np.testing.assert_array_equal(read("rng/python"), tensorckpt.open(ck).read("rng/python").numpy())


def _training_state(tmp_path, edit) -> validate.Report:
    ck = tmp_path / "ck"
    shutil.copytree(HERE / "golden" / "v1" / "training_state" / "checkpoint", ck)
    doc = json.loads((ck / "zarr.json").read_bytes())
    edit(doc["attributes"]["tensorckpt"])
    (ck / "zarr.json").write_text(json.dumps(doc))
    return validate.validate(ck)


def _rename_state(m: dict) -> None:
    m["values"]["optim/state/gone/step"] = m["values"].pop("optim/state/0.bias/step")


@pytest.mark.parametrize("edit, rule", [
    (lambda m: m["values"]["optim/param_groups"][0].update(param_names=["a"]), "optimizer-param-groups"),
    (lambda m: m["values"].update({"optim/extra": 1}), "optimizer-layout"),
    (_rename_state, "optimizer-fqn"),
    (lambda m: m["values"].update({"sched/milestones": {"2": 1}}), "scheduler-pairs"),
    (lambda m: m["values"].update({"data/segments": [[2, [1]]]}), "sampler-counts"),
    (lambda m: m["values"].update({"data/epoch": 1.0}), "sampler-layout"),
    (lambda m: m["tensors"]["rng/numpy"].update(shape=[2, 627], chunk_shape=[2, 627], inner_chunk_shape=[2, 627]),
     "rng-layout"),
])
def test_training_state_rules(tmp_path, edit, rule):
    report = _training_state(tmp_path, edit)
    assert rule in _rules(report) and _rules(report) <= {rule, "array-index"}, validate.render(report)


def _training_state_1_2(tmp_path, edit) -> validate.Report:
    ck = tmp_path / "ck"
    shutil.copytree(HERE / "golden" / "v1" / "training_state_1_2" / "checkpoint", ck)
    doc = json.loads((ck / "zarr.json").read_bytes())
    edit(doc["attributes"]["tensorckpt"]["values"])
    (ck / "zarr.json").write_text(json.dumps(doc))
    return validate.validate(ck)


GID = "f16120e318148b82"  # the id of optim's one group in golden training_state_1_2


def _pop(key: str):
    return lambda v: v.pop(key)


@pytest.mark.parametrize("edit, rule, where", [
    (lambda v: v.update({"optim/group_of/0.bias": "0" * 16}), "optimizer-group-missing", "optim/group_of/0.bias"),
    (lambda v: v.update({f"optim/groups/{GID}/lr": 0.3}), "optimizer-group-id", f"optim/groups/{GID}"),
    (lambda v: v.update({f"optim/groups/{GID}/eps": 1e-8 + 1e-20}), "optimizer-group-id", f"optim/groups/{GID}"),
    (_pop("optim/group_of/2.weight"), "optimizer-group-of", "optim/state/2.weight"),
    (lambda v: v.update({"optim/class": ["AdamW"]}), "optimizer-layout", "optim/class"),
    (lambda v: v.update({"optim/group_of/0.bias": "F16120E318148B82"}), "optimizer-layout", "optim/group_of/0.bias"),
    (lambda v: v.update({"optim/param_groups": [{"params": ["0.bias"], "lr": 0.25}]}), "optimizer-legacy-layout",
     "optim/param_groups"),
    (lambda v: v.update({"sched/class": 3}), "scheduler-class", "sched/class"),
    (lambda v: v.update({"tied/head.weight/tied_to": "embedding.weight"}), "module-tied-to", "tied/head.weight/tied_to"),
    (lambda v: v.update({"tied/head.weight/tied_to": "model/0.weight"}), "module-tied-to", "tied/head.weight/tied_to"),
    (lambda v: v.update({"tied/head.weight/tied_to": 0}), "module-tied-to", "tied/head.weight/tied_to"),
])
def test_training_state_1_2_rules(tmp_path, edit, rule, where):
    """Each edit of the 1.2 golden breaks one rule of 1.2 (training-state.md 3.3, 4.2, 4.4, 5)."""
    report = _training_state_1_2(tmp_path, edit)
    assert {(v.rule, v.where) for v in report.violations} >= {(rule, where)}, validate.render(report)
    assert _rules(report) <= {rule, "optimizer-layout", "unexpected-object"}, validate.render(report)


def test_optimizer_without_class_is_valid_in_1_2(tmp_path):
    """K/class may be absent (a checkpoint converted from torch DCP, which records no class;
    training-state.md 4.2); everything else of the layout is still checked."""
    report = _training_state_1_2(tmp_path, _pop("optim/class"))
    assert report.status == "clean" and not report.violations, validate.render(report)


def test_training_state_1_2_digest_and_what_is_not_a_tie(tmp_path):
    st = validate.validate_state
    assert st.group_id({"lr": 0.1, "betas": [0.9, 0.999], "name": "\u00e9"}) == \
        __import__("hashlib").sha256(b'{"betas":[0.9,0.999],"lr":0.1,"name":"\\u00e9"}').hexdigest()[:16]
    report = _training_state_1_2(tmp_path, lambda v: v.update({"cfg/tied_to": "nothing", "extra/x/tied_to": 1}))
    assert report.exit_code == 0 and "tied entry at tied/head.weight" in report.objects, validate.render(report)
    assert not any(o.startswith("tied entry at cfg") for o in report.objects)


def test_finite_0d_state_tensor_must_be_a_number(tmp_path):
    model = torch.nn.Linear(2, 1)
    gid = validate.validate_state.group_id({"lr": 0.1})
    tensorckpt.save({"model": model.state_dict(), "optim": {
        "class": "SGD", "group_of": {"weight": gid, "bias": gid}, "groups": {gid: {"lr": 0.1}},
        "state": {"weight": {"step": torch.tensor(3.0)}, "bias": {"step": torch.tensor(float("inf"))}}}}, tmp_path / "ck")
    report = validate.validate(tmp_path / "ck")
    assert [(v.rule, v.where) for v in report.violations] == [("optimizer-state-entry", "optim/state/weight/step")]


def test_param_groups_in_a_fresh_checkpoint(tmp_path):
    """A 1.2 checkpoint with the 1.0/1.1 layout: reported (4.4), and its 1.1 rules still apply."""
    model = torch.nn.Linear(2, 1)
    tensorckpt.save({"model": model.state_dict(), "optim": {
        "param_groups": [{"lr": 0.1, "params": ["weight", "bias"]}],
        "state": {"weight": {"step": torch.tensor(3.0)}, "bias": {"step": torch.tensor(float("inf"))}}}}, tmp_path / "ck")
    report = validate.validate(tmp_path / "ck")
    assert [(v.rule, v.where) for v in report.violations] == [("optimizer-legacy-layout", "optim/param_groups"),
                                                              ("optimizer-state-entry", "optim/state/weight/step")]


def test_readme_lists_every_rule():
    text = (HERE / "README.md").read_text()
    for rule, (section, _) in validate.RULES.items():
        assert f"| `{rule}` | {section} |" in text, rule


def test_manager_root_and_staging_location(tmp_path):
    tensorckpt.save({"w": torch.ones(2)}, tmp_path / "root" / "step-00000001")
    report = validate.validate(tmp_path / "root")
    assert report.exit_code == 2 and "step-00000001" in report.notes[0]
    (tmp_path / "root" / "step-00000001").rename(tmp_path / "root" / ".step-00000001.tensorckpt-staging-0123456789ab")
    report = validate.validate(tmp_path / "root" / ".step-00000001.tensorckpt-staging-0123456789ab")
    assert report.exit_code == 0 and "staging" in report.notes[0]


def test_pure_python_crc32c_matches():
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    assert validate.base.crc32c_python(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert validate.base.crc32c_python(data) == validate.base.crc32c(data)
    assert validate.base.crc32c_python(data[500:], validate.base.crc32c_python(data[:500])) == validate.base.crc32c(data)


def test_object_rules_find_their_keys():
    st = validate.validate_state
    rule = st.ObjectRule("x", ("class",), lambda o: None, any_of=("group_of/",))
    values = {"a/b/class": "AdamW", "a/b/group_of/w": "0" * 16, "c/class": "SGD", "class": 1, "group_of/v": 1}
    assert st.find(rule, {}, values) == ["", "a/b"]
    assert st.rules_for((1, 1)) == st.BY_VERSION[(1, 0)] and st.rules_for(None) == st.BY_VERSION[max(st.BY_VERSION)]
    assert st.rules_for((1, 2)) == st.rules_for((1, 7)) == st.BY_VERSION[(1, 2)]
    opt = st.OPTIMIZER_V1_2  # K/class with group_of/groups/state, or group_of/groups alone (K/class missing)
    values = {"a/class": "SGD", "a/state/w/step": 1.0, "b/group_of/w": "0" * 16, "b/state/group_of/x": 1,
              "c/class": "StepLR", "c/base_lrs": [0.1]}
    assert st.find(opt, {}, values) == ["a", "b"]
    tied = st.TIED_V1_2  # K/a/tied_to where K holds a tensor directly
    assert st.find(tied, {"m/w": {}, "n/x/y": {}}, {"m/v/tied_to": "w", "n/v/tied_to": "w", "tied_to": 1}) == ["m/v"]


def test_every_flipped_chunk_byte_is_caught_and_no_input_raises(sharded):
    """Flip random bytes: in a chunk object every flip is a violation; in a
    zarr.json a flip may be harmless, but never makes the validator fail."""
    rng = np.random.default_rng(7)
    files = sorted(p for p in sharded.rglob("*") if p.is_file())
    for p in files:
        original = p.read_bytes()
        for at in rng.choice(len(original), size=min(len(original), 8), replace=False):
            data = bytearray(original)
            data[at] ^= 1 << int(rng.integers(8))
            p.write_bytes(bytes(data))
            report = validate.validate(sharded)
            assert report.status != "unreadable", (p, at, report.notes)
            if p.name != "zarr.json":
                assert report.exit_code == 1 and _rules(report) <= {"chunk-crc", "index-crc", "index-entry",
                                                                       "index-empty", "index-layout"}, (p, at)
        p.write_bytes(original)
    _clean(sharded)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


@pytest.mark.parametrize("golden", ["basic", "training_state"])
def test_mutated_metadata_never_breaks_the_validator(tmp_path, golden):
    """Replace random parts of the root and array zarr.json with JSON of other types."""
    ck = tmp_path / "ck"
    shutil.copytree(HERE / "golden" / "v1" / golden / "checkpoint", ck)
    docs = [p for p in sorted(ck.rglob("zarr.json")) if p.parent == ck or "node_type\": \"array" in p.read_text()][:4]
    junk = [None, [], {}, "x", "%", 1.5, -1, 2**70, [[1, "a"]], {"a": [None]}, True, [1.0, 2.0]]
    rng = np.random.default_rng(3)
    for p in docs:
        original = p.read_bytes()
        paths = list(_paths(json.loads(original)))
        for _ in range(25):
            doc = json.loads(original)
            where = paths[int(rng.integers(len(paths)))]
            value = junk[int(rng.integers(len(junk)))]
            if not where:
                doc = value
            else:
                node = doc
                for k in where[:-1]:
                    node = node[k]
                node[where[-1]] = value
            p.write_text(json.dumps(doc))
            report = validate.validate(ck)
            assert report.status != "unreadable", (p, where, value, report.notes)
        p.write_bytes(original)
