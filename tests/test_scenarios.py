"""Scenario evidence: what a planted problem's finding says, read from the shared runs of the scenario matrix
(tests/scenario_matrix.py; tests/test_scenario_matrix.py checks every row's finding, baseline and fix). Each
problem must yield its code at its severity with the evidence and names of the model itself."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def _finding(matrix, row):
    o = matrix[row]
    assert not o.error, o.error
    assert o.finding is not None, [(f.code, f.severity) for f in o.findings]
    return o.finding, o.report


# the scenarios whose findings need few steps and no timing luck also run on the ends of the torch range
@pytest.mark.compat
@pytest.mark.parametrize("row,code", [("gpt_whole", "wrap.too_coarse"), ("gpt_blocks_only", "wrap.params_in_root"),
                                      ("gpt_no_root", "wrap.root_not_sharded"),
                                      ("gpt_optimizer_before_shard", "optim.before_shard")])
def test_scenario_yields_its_code(matrix, row, code):
    f, _ = _finding(matrix, row)
    assert f.code == code and f.evidence and f.recommendation.text and f.recommendation.code


@pytest.mark.compat
@pytest.mark.rows("gpt_sync_unshard")
def test_sync_unshard_on_gloo(matrix):
    f, report = _finding(matrix, "gpt_sync_unshard")
    assert f.evidence["units_sync"] == 6
    assert f.evidence["blocking_calls"], "the trace should show the host blocked in all-gathers"
    assert "_set_unshard_async_op(True)" in f.recommendation.code
    # the exposed all-gathers are reported, but point at the synchronous unshard first
    for g in report.findings:
        if g.code == "prefetch.exposed_allgather":
            assert g.severity == "info"


@pytest.mark.rows("gpt_leaf")
def test_specific_evidence(matrix):
    """Names from the model itself end up in the recommendations."""
    f, _ = _finding(matrix, "gpt_leaf")
    assert "model.layers" in f.recommendation.code
    assert f.evidence["units"] >= 24


@pytest.mark.rows("gpt_tuned")
def test_tuned_baseline_is_healthy_in_words(matrix):
    from io import StringIO

    from rich.console import Console

    import scenario_matrix as M
    from fsdp_doctor.present.terminal import render_findings

    o = matrix["gpt_tuned"]
    assert not o.error, o.error
    noise = M.warnings_of(o.findings) & M.NOISE  # host noise (a shared 2-core VM) aside
    buf = StringIO()
    Console(file=buf, width=100).print(render_findings([f for f in o.findings if f.code not in noise]))
    # "Healthy" only with no finding at all; notes (info) are announced as such, never as "healthy" (issue #13)
    assert buf.getvalue().startswith(("Healthy: no findings.", "No warnings; "))
