"""tensorckpt format conformance: golden v1 checkpoints and a reusable pytest
suite (see README.md), and a checkpoint validator that needs no tensorckpt
(``python -m conformance.validate PATH``)."""
