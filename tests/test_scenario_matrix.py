"""The scenario matrix (tests/scenario_matrix.py): every planted problem on its model trees is found at its
severity, every tuned baseline has no warning, and every fix the diagnosis prints, pasted where it says, is
rechecked in a fresh run: the finding gone (or its figure improved by at least half the prediction), no new
warning, the peak within 10% of the predicted one. Step-time predictions are recorded (benchmarks/scenarios.py
prints them beside the measured step), not asserted on this noisy host."""

from __future__ import annotations

import pytest

import scenario_matrix as M

pytestmark = pytest.mark.slow

PLANTED = [r.name for r in M.ROWS if r.code]
BASELINES = [r.name for r in M.ROWS if r.code is None]
APPLIED = [pytest.param(r.name, marks=pytest.mark.xfail(reason=M.KNOWN_WRONG[r.name], strict=True))
           if r.name in M.KNOWN_WRONG else r.name for r in M.ROWS if r.code and r.apply]


def _ran(o: M.Outcome) -> M.Outcome:
    assert not o.error, o.error
    return o


@pytest.mark.parametrize("row", PLANTED)
def test_planted_problem_is_found(matrix, row):
    o, r = _ran(matrix[row]), M.BY_NAME[row]
    assert o.finding is not None, (f"{row}: expected {r.code} at {r.min_severity}+, got "
                                   f"{[(f.code, f.severity) for f in o.findings]}; "
                                   + next((f"{s.status}: {s.reason}" for s in o.report.rules if s.code == r.code), ""))
    assert o.finding.evidence and o.finding.recommendation.text


@pytest.mark.parametrize("row", [r.name for r in M.ROWS if r.code and not r.apply])
def test_advice_in_words_prints_no_code(matrix, row):
    """Where the lever is the user's code the doctor does not see (the data pipeline, what one rank does, the batch
    size), the finding says what to look for in words: no template with placeholders to paste."""
    o = _ran(matrix[row])
    assert o.finding is not None and o.finding.recommendation.text
    assert o.finding.recommendation.code == "", o.finding.recommendation.code


@pytest.mark.parametrize("row", BASELINES)
def test_tuned_baseline_has_no_warning(matrix, row):
    o = _ran(matrix[row])
    assert M.warnings_of(o.findings) - M.NOISE == set(), [(f.code, f.severity, f.title) for f in o.findings]


@pytest.mark.parametrize("row", APPLIED)
def test_fix_applied_and_rechecked(matrix, row):
    o = _ran(matrix[row])
    assert o.finding is not None, row
    assert o.fix, f"{row}: {o.finding.code} prints no code"
    assert o.fix["where"] in ("unsharded", "sharded", "optimizer", "loop")
    assert not o.after_error, (o.after_error, o.fix["code"])
    rc = o.recheck()
    assert not rc["new_warnings"], (rc, o.fix["code"])
    assert not M.changed_options(o), (M.changed_options(o), o.fix["code"])  # the user's other options kept
    if o.row.gpu_gain:  # its gain is overlap a GPU has (the rule predicts none on gloo): rechecked there
        return
    assert rc["gone"] or rc["improved"], (rc, o.fix["code"])
    if rc["peak_ok"] is not None:
        assert rc["peak_ok"], (rc["peak_measured"], rc["peak_predicted"], o.fix["code"])


@pytest.mark.rows(*[r.name for r in M.ROWS])
def test_every_quiet_rule_says_why_on_every_row(matrix):
    """Every rule that stayed quiet on a row's run says why (its figure against its threshold), on every tree."""
    from fsdp_doctor.diagnose import NO_REASON

    bare = {(name, s.code) for name, o in matrix.items() if o.report is not None
            for s in o.report.rules if s.status == "quiet" and s.reason == NO_REASON}
    assert not bare, sorted(bare)
