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
