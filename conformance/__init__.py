"""tensorckpt format conformance: golden v1 checkpoints and a reusable pytest
suite (see README.md)."""
