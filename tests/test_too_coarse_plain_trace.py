"""A plain trace of a model sharded as one unit (fully_shard(model) alone): wrap.too_coarse from the trace's
all-gather sizes, and the rules that advised around it as if there were units to prefetch or keep small.

A new-user trial's Whisper under fully_shard(model) alone, traced with torch.profiler, read "No findings" but for
prefetch.sync_unshard, a warning whose fix (the root's all-gather made asynchronous) has nothing to overlap; the
H100 GPT's whole-model trace read "prefetch the next unit explicitly" and "keep the first unit small"."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fsdp_doctor.pipeline import build_report
from fsdp_doctor.store import load_run
from trace_fixtures import ProfileWindow

GPU_SCENARIOS = Path(__file__).resolve().parent.parent / "traces" / "gpu" / "scenarios"


def _rules(rep):
    found = {f.code: f for f in rep.findings}
    status = {r.code: r for r in rep.rules}
    return found, status


def test_h100_whole_model_trace_reads_one_unit():
    """The H100 GPT sharded as one unit (traces/gpu/scenarios/gpu_gpt_whole), its profiler folder alone: the root's
    forward all-gather moves every parameter in bf16 (39,370,752 B, the records' unsharded bytes of the root); the
    tuned run's trace, its blocks units of their own, stays quiet with the largest unit's share."""
    rep = build_report(load_run(GPU_SCENARIOS / "gpu_gpt_whole" / "profiler"))
    assert rep.units is None  # a plain trace: no unit snapshot
    found, status = _rules(rep)
    tc = found["wrap.too_coarse"]
    assert tc.severity == "warning" and tc.title == "Unit '(root)' gathers 100% of all parameters (trace)"
    assert tc.evidence["gathered_bytes"] == 39_370_752 and tc.evidence["units_in_trace"] == 1
    assert tc.evidence["trace_exposed_ag_fwd_ms"] == pytest.approx(10.8, abs=0.05)
    text = tc.recommendation.text
    assert "(the whole model is one unit: fully_shard was applied only to the root)" in text
    assert "(about 18.77 MiB with 4)" in text and "overlaps with the previous block's compute" in text
    assert tc.recommendation.code == "" and not tc.predicted  # a trace names no module; no figures predicted
    # no "prefetch the next unit" where there is none, and the reduce-scatters said of one unit
    ag = status["prefetch.exposed_allgather"]
    assert ag.status == "quiet" and ag.reason.startswith("the root is the only unit: compute waits 10.80 ms")
    rs = found["comm.exposed_reducescatter"].recommendation.text
    assert rs.startswith("The whole model is one unit: its reduce-scatter of every gradient starts when the whole")
    assert "Keep the first unit small" not in rs

    tuned = build_report(load_run(GPU_SCENARIOS / "gpu_gpt_tuned" / "profiler"))
    found, status = _rules(tuned)
    assert "wrap.too_coarse" not in found
    assert status["wrap.too_coarse"].reason.startswith("the largest unit in the trace, ")
    assert "(fires from 50%)" in status["wrap.too_coarse"].reason
    if "comm.exposed_reducescatter" in found:
        assert "Keep the first unit small" in found["comm.exposed_reducescatter"].recommendation.text


@pytest.fixture(scope="module")
def whole_gloo_traces(tmp_path_factory):
    """The reference GPT sharded as one unit on 2 gloo ranks, synchronous unshard, profiled by plain torch.profiler
    with record_shapes (the collectives' sizes) and profile_memory, and again without record_shapes."""
    workloads = pytest.importorskip("fsdp_doctor.workloads")
    from fsdp_doctor.workloads.gpt import total_param_count

    cfg = workloads.WorkloadConfig(wrap="whole", d_model=128, n_layers=4, seq_len=64, steps=4)
    out = {}
    for shapes in (True, False):
        d = tmp_path_factory.mktemp("whole_shapes" if shapes else "whole_noshapes")
        hook = ProfileWindow(d, warmup=1, active=2, profile_memory=True, record_shapes=shapes)
        workloads.launch(dataclasses.replace(cfg, steps=hook.steps_needed()), nproc=2, on_step=hook, timeout_s=300)
        out[shapes] = build_report(load_run(d))
    return out, total_param_count(cfg)


@pytest.mark.slow
def test_gloo_whole_model_trace(whole_gloo_traces):
    """Known answer: the root's all-gather moves the model's float32 parameters (total_param_count x 4 B); on gloo the
    split frees half of them at the peak with 4 blocks, said as memory only; the synchronous unshard of the root
    alone is no finding (its fix has nothing to overlap). Without record_shapes the trace has no sizes: quiet, saying
    which option records them."""
    reps, params = whole_gloo_traces
    found, status = _rules(reps[True])
    tc = found["wrap.too_coarse"]
    assert tc.evidence["gathered_bytes"] == 4 * params and tc.evidence["gathered_share_pct"] == 100.0
    assert "On a CPU/gloo host the gain is memory only" in tc.recommendation.text
    assert "fsdp_doctor.watch(model, optimizer)" in tc.recommendation.text
    assert "prefetch.sync_unshard" not in found
    assert status["prefetch.sync_unshard"].reason.startswith("the root is the only unit in the trace")
    found, status = _rules(reps[False])
    assert "wrap.too_coarse" not in found
    assert status["wrap.too_coarse"].reason == ("the trace records no FSDP all-gather's size (torch.profiler's "
                                                "record_shapes=True records them)")
