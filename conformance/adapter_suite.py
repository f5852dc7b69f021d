"""The adapter conformance suite: save training objects at one layout, load them
at another, check the files on disk without the implementation, and check what
the resumed run sees. See conformance/README.md ("Adapter conformance").

An adapter author subclasses :class:`AdapterConformance` as ``Test<Name>`` and
implements four hooks::

    class TestMyAdapter(AdapterConformance):
        def build(self, objs):            # objs: adapter_objects.Objects of one rank at one layout
            return {"model": ..., "optim": ..., "sched": ..., "data": ..., "rng": ..., "extra": objs.extra}
        def save(self, state, path): ...  # a collective on every rank
        def load(self, state, path): ...  # fills the objects of ``state`` in place
        def consume(self, state, n): ...  # the next n sample indices of state["data"] (None: all), counted consumed

The suite spawns its own gloo process groups (``adapter_run``), as few as the
matrix allows, and runs every case in them; each suite test then checks one
property for every case (parametrized by case name). The default matrix fits a
CI budget; ``TENSORCKPT_CONFORMANCE_FULL=1`` runs the larger one.

Imports only torch, numpy, tensorstore, jsonschema and pytest (never tensorckpt).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from . import adapter_checks as checks
from .adapter_objects import Layout, Objects
from .adapter_run import Case, checkpoint_path, run

FULL = os.environ.get("TENSORCKPT_CONFORMANCE_FULL", "") not in ("", "0")

P1 = Layout("plain", 1)
FSDP2, FSDP3, FSDP4 = Layout("fsdp", 2), Layout("fsdp", 3), Layout("fsdp", 4)
TP2, TP3, TP4 = Layout("tp", 2), Layout("tp", 3), Layout("tp", 4)
FSDP_TP4 = Layout("fsdp_tp", 4, (2, 2))
BOXES2, BOXES3, BOXES4 = Layout("boxes", 2, variant=0), Layout("boxes", 3, variant=0), Layout("boxes", 4, variant=1)
PP2, PP4 = Layout("pp", 2), Layout("pp", 4)

# Two spawned launches (3 ranks: every save; 4 ranks: every load, and the saves world 1 loads in-process).
DEFAULT_MATRIX = [
    Case(FSDP3, FSDP_TP4),  # uneven FSDP2 shards -> a 2-D mesh; DP 3 -> 2; a new rank's RNG
    Case(TP3, FSDP4),  # TP -> FSDP2; DP 1 -> 4; a new rank
    Case(BOXES3, BOXES4),  # explicit boxes, irregular splits 3 -> 4
    Case(FSDP3, PP4),  # into pipeline stages (the stage modules name their layers from 0)
    Case(FSDP_TP4, P1),  # a 2-D mesh -> one process
    Case(PP4, P1),  # pipeline stages renumbered -> one process
]
FULL_MATRIX = DEFAULT_MATRIX + [
    Case(FSDP4, TP2), Case(FSDP_TP4, FSDP3), Case(PP4, PP2), Case(PP2, PP4), Case(TP2, FSDP3),
    Case(BOXES2, BOXES3), Case(BOXES4, BOXES2), Case(FSDP2, P1), Case(P1, FSDP_TP4), Case(FSDP3, FSDP2),
    Case(FSDP2, FSDP4), Case(TP4, TP2), Case(P1, PP2), Case(TP2, FSDP_TP4), Case(FSDP_TP4, TP3),
    Case(BOXES2, BOXES2),
]


def matrix() -> list[Case]:
    return FULL_MATRIX if FULL else DEFAULT_MATRIX


_RESULTS: dict[tuple, dict] = {}


def results_for(cls: type[AdapterConformance], base: Path, cases: list[Case] | None = None) -> dict[str, dict[str, checks.CaseResult]]:
    """Run ``cls`` and its ``companions`` over the matrix once per process (cached):
    ``{adapter class name: {case name: CaseResult}}``."""
    from .adapter_objects import reference

    cases = matrix() if cases is None else cases
    extra = list(cases if cls.companion_cases is None else cls.companion_cases)
    plan = [(cls, cases)] + [(a, extra) for a in cls.companions]
    key = tuple((a.__qualname__, tuple(c.name for c in cs)) for a, cs in plan)
    if key not in _RESULTS:
        raw = run(plan, base)
        ref = reference()
        _RESULTS[key] = {
            a.__name__: {c.name: checks.CaseResult(a.__name__, c, checkpoint_path(base, a, c),
                                                   raw[(a.__name__, c.name, "save")], raw[(a.__name__, c.name, "load")], ref)
                         for c in cs}
            for a, cs in plan
        }
    return _RESULTS[key]


def _case_names() -> list[str]:
    return [c.name for c in matrix()]


class AdapterConformance:
    """Subclass as ``Test<Name>``; implement ``build``, ``save``, ``load``, ``consume``.

    ``companions``: other adapter classes run in the same process groups, over
    ``companion_cases`` (a mutation test of the suite uses it to share the launches)."""

    companions: tuple[type, ...] = ()
    companion_cases: tuple[Case, ...] | None = None  # the companions' cases (None: the same matrix)

    # -- hooks
    def build(self, objs: Objects) -> dict:
        """The state to save / load for ``objs``, keyed ``model`` (the module, under
        its pipeline renumbering when ``objs.stage_offset`` is set, or the explicit
        boxes ``objs.boxes``), ``optim``, ``sched`` (absent for boxes), ``data`` (a
        sampler over ``objs.num_samples`` samples, seed ``objs.seed``, shuffled, at
        ``objs.dp_rank`` of ``objs.dp_world``), ``rng`` (every generator of this
        rank) and ``extra`` (``objs.extra`` as it is)."""
        raise NotImplementedError("implement build(objs) -> state")

    def save(self, state: dict, path: str) -> None:
        raise NotImplementedError("implement save(state, path)")

    def load(self, state: dict, path: str) -> None:
        raise NotImplementedError("implement load(state, path)")

    def consume(self, state: dict, n: int | None) -> list[int]:
        """The next ``n`` sample indices of ``state["data"]`` on this rank (all the
        rest of the epoch when None), counted as consumed by the training loop."""
        raise NotImplementedError("implement consume(state, n)")

    # -- the run
    @pytest.fixture(scope="class")
    @classmethod
    def conformance(cls, tmp_path_factory) -> dict[str, checks.CaseResult]:
        return results_for(cls, tmp_path_factory.mktemp("adapter-conformance"))[cls.__name__]

    def _check(self, conformance: dict, case: str, name: str) -> None:
        try:
            checks.CHECKS[name](conformance[case])
        except checks.NotApplicable as e:
            pytest.skip(str(e))

    # -- on disk, read without the implementation
    @pytest.mark.parametrize("case", _case_names())
    def test_checkpoint_validates(self, conformance, case):
        self._check(conformance, case, "test_checkpoint_validates")

    @pytest.mark.parametrize("case", _case_names())
    def test_tensors_match_reference(self, conformance, case):
        self._check(conformance, case, "test_tensors_match_reference")

    @pytest.mark.parametrize("case", _case_names())
    def test_tensor_dtypes(self, conformance, case):
        self._check(conformance, case, "test_tensor_dtypes")

    @pytest.mark.parametrize("case", _case_names())
    def test_extra_state(self, conformance, case):
        self._check(conformance, case, "test_extra_state")

    @pytest.mark.parametrize("case", _case_names())
    def test_optimizer_moments_under_fqns(self, conformance, case):
        self._check(conformance, case, "test_optimizer_moments_under_fqns")

    @pytest.mark.parametrize("case", _case_names())
    def test_optimizer_moments_global_shape(self, conformance, case):
        self._check(conformance, case, "test_optimizer_moments_global_shape")

    @pytest.mark.parametrize("case", _case_names())
    def test_optimizer_param_groups(self, conformance, case):
        self._check(conformance, case, "test_optimizer_param_groups")

    @pytest.mark.parametrize("case", _case_names())
    def test_scheduler_state(self, conformance, case):
        self._check(conformance, case, "test_scheduler_state")

    @pytest.mark.parametrize("case", _case_names())
    def test_sampler_state(self, conformance, case):
        self._check(conformance, case, "test_sampler_state")

    @pytest.mark.parametrize("case", _case_names())
    def test_rng_rows_per_rank(self, conformance, case):
        self._check(conformance, case, "test_rng_rows_per_rank")

    # -- behaviour after the load at the other layout
    @pytest.mark.parametrize("case", _case_names())
    def test_resumed_loss_matches_uninterrupted(self, conformance, case):
        self._check(conformance, case, "test_resumed_loss_matches_uninterrupted")

    @pytest.mark.parametrize("case", _case_names())
    def test_loaded_state_matches_saved(self, conformance, case):
        self._check(conformance, case, "test_loaded_state_matches_saved")

    @pytest.mark.parametrize("case", _case_names())
    def test_samples_seen_exactly_once(self, conformance, case):
        self._check(conformance, case, "test_samples_seen_exactly_once")

    @pytest.mark.parametrize("case", _case_names())
    def test_rng_streams_follow_spec(self, conformance, case):
        self._check(conformance, case, "test_rng_streams_follow_spec")
