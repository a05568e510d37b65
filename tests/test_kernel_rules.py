"""Low MFU's kernel levers from GPU traces: eager attention (known-answer traces built here) and a launch-bound
step (a known-answer FSDP2-shaped trace, and the real host-bound A100 trace under shared/reference_traces)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import HTA_TRACES
from trace_fixtures import TraceBuilder, fsdp_gpu_trace

HERE = Path(__file__).resolve().parent

EAGER = ("ampere_sgemm_128x64_tn", "void (anonymous namespace)::softmax_warp_forward<float, float, float, 7, false, "
         "false>(float*, float const*, int, int, int, bool const*, int, bool)", "ampere_sgemm_64x64_nn")
FLASH = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>, true>(Flash_fwd_params)",)
LOSS = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true, false>(float*, float const*)"


def attention_trace(kernels, layers=4, steps=2, us=(30.0, 20.0, 30.0), units: str = "") -> TraceBuilder:
    """``steps`` complete steps (plus one cut) of ``layers`` attention blocks back to back on stream 7 and one
    log-softmax (the loss) per step: per step the softmax kernels take layers x ``us[1]`` µs. ``units``: a
    format for each block's FSDP unit label (e.g. "model.layers.{}"), none by default."""
    b = TraceBuilder(rank=0, world_size=1)
    t = 0.0
    for k in range(steps + 1):
        start = t
        if units:
            b.label("FSDP::root_pre_forward", t - 4.0, 0.5)
        for i in range(layers):
            if units:
                b.label(f"FSDP::pre_forward ({units.format(i)})", t - 3.0, 0.5)
                b.label(f"FSDP::post_forward ({units.format(i)})", t + sum(us) - 0.5, 0.5)
            for name, d in zip(kernels, us):
                b.kernel(name, t, d, launch_ts=t - 5.0)
                t += d
        b.kernel(LOSS, t, 10.0, launch_ts=t - 5.0)
        t += 10.0
        b.step(k + 1, start - 5.0, t - start + 5.0)
    return b


def _report(tmp_path, b, name="rank0.json"):
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.store import load_run

    f = b.write(tmp_path / name)
    return build_report(load_run(f))


def _status(report, code):
    return next(s for s in report.rules if s.code == code)


def test_eager_attention_known_answer(tmp_path):
    report = _report(tmp_path, attention_trace(EAGER))
    k = report.overlap.kernels["0"]
    assert k.softmax_count == 8 and k.fused_attention_count == 0 and k.gemm_count == 16  # the loss's not counted
    f = next(f for f in report.findings if f.code == "kernels.eager_attention")
    assert f.evidence["softmax_kernels_per_step"] == 4 and f.evidence["softmax_ms_per_step"] == pytest.approx(0.08)
    assert f.evidence["matmul_ms_per_step"] == pytest.approx(0.24)
    # no module tree in this trace: the attention module is the user's code, the lever is said in words
    assert f.recommendation.code == "" and "scaled_dot_product_attention(q, k, v" in f.recommendation.text
    assert f.predicted.step_ms_delta == pytest.approx(-0.08, abs=1e-3)


def test_eager_attention_of_a_hugging_face_tree_switches_its_implementation(tmp_path):
    """A trace whose units are a Hugging Face causal LM's decoder layers: the fix is the model's own setting
    (tests/test_kernel_fixes.py applies it to an HF Llama built with eager attention: no softmax op is left)."""
    report = _report(tmp_path, attention_trace(EAGER, units="model.layers.{}"))
    f = next(f for f in report.findings if f.code == "kernels.eager_attention")
    assert "model.set_attn_implementation('sdpa')" in f.recommendation.code
    assert f.recommendation.where == "sharded"


def test_fused_attention_is_quiet(tmp_path):
    report = _report(tmp_path, attention_trace(FLASH, us=(40.0,)))
    assert report.overlap.kernels["0"].fused_attention_count == 8
    st = _status(report, "kernels.eager_attention")
    assert st.status == "quiet" and st.reason.startswith("fused attention kernels run")


def test_launch_bound_known_answer(tmp_path):
    """Kernels of 5 µs launched every 20 µs: the device waits for the host most of the step, every kernel is
    small; with 200 µs kernels launched at once the rule is quiet."""
    report = _report(tmp_path, fsdp_gpu_trace(units=8, fwd_us=5.0, bwd_us=5.0, ag_us=2.0, launch_gap_us=20.0,
                                              prefetch=True))
    f = next(f for f in report.findings if f.code == "kernels.launch_bound")
    assert f.evidence["small_kernel_share_pct"] == 100.0 and f.evidence["host_bound_pct"] >= 50
    assert f.evidence["launch_waited_pct"] == 100.0  # every kernel starts at its launch: the device waited
    # FSDP2's labels here are a few ns each, under the 20% of the step from which fewer units would be the lever:
    # the fix compiles, and quotes no gain (on the H200 compiling measured from -12% to +27% on a tiny GPT)
    ev = f.evidence
    assert 0 < ev["fsdp_host_ms_per_step"] < 0.2 * f.predicted.step_ms_before
    assert f.predicted.step_ms_after is None and "No gain is quoted" in f.recommendation.text
    # every block of the trace's layers container, compiled in place after fully_shard
    assert "for block in model.layers.children():\n    block.compile()" in f.recommendation.code
    busy = _report(tmp_path, fsdp_gpu_trace(units=8, fwd_us=200.0, bwd_us=200.0, ag_us=2.0, prefetch=True),
                   "busy.json")
    assert _status(busy, "kernels.launch_bound").status == "quiet"


def test_launch_bound_on_the_real_host_bound_trace():
    """HTA's A100 DDP trace, 72% host-bound, was "Healthy: no findings."; 43% of its kernels are under 10 µs. (Over
    its 3 steps: its last is whole, torch.profiler's cudaDeviceSynchronize after it; over steps 4-5 alone, HTA's, it
    read 72.8% host-bound, 43.1% small kernels, 79.1% launch-waited.)"""
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.fmt import findings_headline
    from fsdp_doctor.store import load_run

    path = HTA_TRACES / "a100_ddp_allreduce_rank0"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    report = build_report(load_run(path))
    f = next(f for f in report.findings if f.code == "kernels.launch_bound")
    assert f.severity == "warning" and f.evidence["host_bound_pct"] == pytest.approx(71.7, abs=0.1)
    assert f.evidence["kernels_per_step"] == pytest.approx(893, abs=1)
    assert f.evidence["small_kernel_share_pct"] == pytest.approx(43.2, abs=0.1)
    # the launch-bound signature: 2,124 of its 2,679 compute kernels started within 50 µs of their launch
    assert f.evidence["launch_waited_pct"] == pytest.approx(79.3, abs=0.1)
    assert _status(report, "verdict.severe").status == "quiet"  # the specific finding names the lever
    assert not findings_headline(report.findings).startswith("Healthy")
    # a DDP trace names no FSDP unit: the fix compiles the model (it printed an empty list of units to compile)
    assert f.recommendation.code.splitlines()[-1] == "model.compile()", f.recommendation.code
    # ... and the words say the same ("Compile each FSDP block in place" read beside it: a new-user trial)
    assert "The trace names no FSDP unit: compile the model in place." in f.recommendation.text
    assert "FSDP block" not in f.recommendation.text, f.recommendation.text
    # ... and where it goes: it read "Fix (Python, after your fully_shard calls):" on a run without fully_shard
    assert f.recommendation.where == "model"
    # its all-reduces are not an "FSDP units" table, and all-gathers' slack and held figures are not explained
    from rich.console import Console

    from fsdp_doctor.present.terminal import render_report

    console = Console(width=100, record=True)
    render_report(report, console)
    out = console.export_text()
    assert "Collectives (no FSDP unit in the traces), worst exposure first" in out and "FSDP units" not in out
    assert "Fix (Python, after your model is built (and wrapped), before the training loop):" in out
    assert "Slack:" not in out


def test_launch_bound_by_fsdp_hooks_is_one_unit():
    """The recorded H200 row gpu_gpt_tiny_launch_bound (the reference GPT, 4 blocks of width 64, 2 x 32 tokens, one
    rank; traces/gpu/): 225 kernels per step, the device waiting for launches 84% of the profiled 40.5 ms step,
    13.55 ms of it the host inside FSDP2's labels over 6 units. Each block compiled (the fix printed until then)
    measured 18.9 -> 31.3 ms on its rerun there; side by side (benchmarks/launch_levers.py) 23.3 -> 29.6 ms
    compiled, one unit 13.8 ms. The fix is now one unit for the whole model, predicted from FSDP's host time (5 of
    its 6 shares, on the records' steady step): 30.26 -> 21.82 ms; its rerun measured 19.30 ms."""
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.store import load_run

    path = HERE.parent / "traces" / "gpu" / "scenarios" / "gpu_gpt_tiny_launch_bound"
    if not (path / "manifest.json").exists():
        pytest.skip(f"{path} is not recorded")
    report = build_report(load_run(path))
    f = next(f for f in report.findings if f.code == "kernels.launch_bound")
    ev = f.evidence
    assert ev["units"] == 6 and ev["fsdp_host_ms_per_step"] == pytest.approx(13.552, abs=1e-3)
    assert ev["fsdp_host_share_pct"] == 33.5
    trace_step = report.overlap.per_rank["0"].step_ms
    assert f.predicted.step_ms_before == pytest.approx(30.26)  # the records' steady step
    assert f.predicted.step_ms_after == pytest.approx(30.26 - 13.552 * 5 / 6 * 30.26 / trace_step, abs=2e-3)
    assert f.recommendation.code.endswith("# one FSDP unit for the whole model (6 units -> 1)\n"
                                          "# replaces your fully_shard calls (apply to the unsharded model)\n"
                                          "fully_shard(model, mesh=mesh)")
    assert f.recommendation.where == "unsharded"
    # the cost said: every unit gathered from forward to backward
    assert f.predicted.peak_bytes_after - f.predicted.peak_bytes_before == 850.25 * 1024
