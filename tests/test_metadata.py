"""The root metadata document as written."""

from __future__ import annotations

import random

from tensorckpt.format.metadata import ATTRIBUTE, RootMetadata, TensorEntry, dumps, root_group_json


def test_root_json_is_the_documents_dumps():
    """root_group_json splices cached entry texts; the bytes must be exactly
    those of serializing the whole document (keys needing escapes, a user
    member named like ours, save_stats or not)."""
    rng = random.Random(1)
    for trial in range(100):
        tensors = {
            f"k{rng.randint(0, 10**6)}/é\"{i}": TensorEntry(rng.choice(["float32", "bfloat16", "int8"]), (i + 1, 3), (i + 1, 3), (1, 3))
            for i in range(rng.randint(0, 20))
        }
        meta = RootMetadata(
            tensors, {"step": trial, "x": {"a": [1, 2.5, "s"], "tensors": {}}}, world_size=rng.randint(1, 9),
            user_metadata={"tensors": {'"q': 1}},
            save_stats=rng.choice([None, {"seconds": {"plan": [0.1]}, "bytes_written": [3]}]),
        )
        whole = dumps({"zarr_format": 3, "node_type": "group", "attributes": {ATTRIBUTE: meta.to_json()}})
        assert root_group_json(meta) == whole, trial


def test_a_sealed_root_is_the_documents_dumps_with_its_checksum_last():
    """Format 1.3 (spec 9.8): with a checkpoint_id, root_group_json ends the
    document with the checksum member, the SHA-256 of the bytes with its
    digits as zeros; parse_root checks it, and any flipped bit fails."""
    import hashlib

    import pytest

    from tensorckpt.errors import CorruptCheckpointError
    from tensorckpt.format.metadata import check_seal, loads, parse_root

    meta = RootMetadata({"w": TensorEntry("float32", (2, 3), (2, 3), (2, 3))}, {"lr": 0.001, "step": 7},
                        checkpoint_id="ab" * 16, array_digests={"w": "c" * 64})
    raw = root_group_json(meta)
    doc = dict(loads(raw, "x"))
    attrs = doc["attributes"][ATTRIBUTE]
    stored = attrs.pop("checksum")
    assert list(doc["attributes"][ATTRIBUTE]) == [*meta.to_json()]  # every member before it, in order
    assert raw == dumps({"zarr_format": 3, "node_type": "group", "attributes": {ATTRIBUTE: {
        **meta.to_json(), "checksum": stored}}})
    assert stored == hashlib.sha256(raw.replace(stored.encode(), b"0" * 64)).hexdigest()
    check_seal(raw, stored, "x")
    assert parse_root(loads(raw, "x"), "x", raw).values["lr"] == 0.001
    flipped = raw.replace(b"0.001", b"1.001")
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        parse_root(loads(flipped, "x"), "x", flipped)
