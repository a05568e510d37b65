"""The HTML report: one self-contained file (plotly.js inline, nothing fetched) with findings and figures."""

from __future__ import annotations

import json
import re

from fsdp_doctor.present.html import render_html, write_html

MiB = 1 << 20


def _report(findings=None):
    mem_rank = {"peak_bytes": 24 * MiB, "peak_at": {"step": 3, "unit": "norm, lm_head", "phase": "forward_end"},
                "peak_breakdown": {"sharded_params": 2 * MiB, "unsharded_params": MiB // 4, "optimizer_state": 4 * MiB,
                                   "activations": 16 * MiB, "comm_buffers": 0, "temporaries": 0},
                "activations_peak_bytes": 16 * MiB, "capacity_bytes": 12 * MiB,
                "per_unit": [{"unit": f"layers.{i}", "sharded_bytes": 396_544, "unsharded_bytes": 793_088,
                              "activation_bytes": 4 * MiB} for i in range(4)]}
    per_unit = [{"rank": r, "unit": f"layers.{i}", "collective": c, "phase": p, "count": 1, "comm_us": 3000.0,
                 "exposed_us": 1500.0, "bytes_per_call": None, "busbw_gbps": None, "slack_us": None, "held_us": None}
                for r in (0, 1) for i in range(4)
                for c, p in (("all_gather", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward"))]
    ph = {"forward": 34.0, "backward": 61.0, "optimizer": 13.0, "outside": 2.0, "gc": 0.0}
    st = {"count": 8, "p50_ms": 110.0, "p90_ms": 120.0, "p99_ms": 130.0, "max_ms": 131.0, "cv": 0.08,
          "phases_p50_ms": ph}
    return {
        "schema": "fsdp-doctor-report/1", "doctor_version": "0.1.0",
        "run": {"path": "runs/x", "world_size": 2, "units": 7, "model_param_count": 932_608, "backend": "gloo",
                "capacity_bytes": 12 * MiB},
        "steps": {"per_rank": {"0": st, "1": st}, "job": {"p50_ms": 110.0, "phases_p50_ms": ph},
                  "outliers": [{"rank": 1, "step": 9, "ms": 180.0, "median_ms": 110.0, "excess_ms": 70.0,
                                "cause": "gc", "detail": "GC 60 ms"}], "stragglers": []},
        "units": [{"name": "", "modules": [""], "is_root": True, "param_count": 0, "n_params": 0, "sharded_bytes": 0,
                   "unsharded_bytes": 0, "orig_dtypes": [],
                   "timing_p50": {"fwd_ms": 34.0, "ag_wait_fwd_ms": 0.2, "bwd_ms": 0.0, "ag_wait_bwd_ms": 0.0,
                                  "fwd_self_ms": 10.0, "bwd_self_ms": None}}]
                 + [{"name": f"layers.{i}", "modules": [f"layers.{i}"], "is_root": False, "param_count": 198_272,
                     "n_params": 6, "sharded_bytes": 396_544, "unsharded_bytes": 793_088, "orig_dtypes": ["float32"],
                     "depth": 1,
                     "timing_p50": {"fwd_ms": 6.0, "ag_wait_fwd_ms": 3.0, "bwd_ms": 6.0, "ag_wait_bwd_ms": 1.0,
                                    "recompute_ms": 0.0, "fwd_self_ms": 6.0, "bwd_self_ms": 6.0}} for i in range(4)],
        "memory": {"per_rank": {"0": mem_rank, "1": mem_rank}},
        "overlap": {"per_rank": {"0": {"comm_us": 36000.0, "overlap_us": 18000.0, "exposed_us": 18000.0,
                                       "overlap_pct": 50.0, "steps": [6], "device": "cpu"}},
                    "per_unit": per_unit},
        "findings": findings if findings is not None else [
            {"code": "ac.recommended", "severity": "critical", "title": "Activations are 67% of the peak </script>",
             "evidence": {"peak_bytes": 24 * MiB, "recompute_ms_added": 20.0, "blocks_to_checkpoint": ["layers.0"]},
             "recommendation": {"text": "Checkpoint <blocks> & co.", "code": "apply_activation_checkpointing(model)"},
             "predicted": {"step_ms_before": 110.0, "step_ms_after": 130.0, "peak_bytes_before": 24 * MiB,
                           "peak_bytes_after": 10 * MiB}, "ranks": [], "units": ["layers.0"]}],
        "problems": [],
    }


def _scripts(text: str) -> list[str]:
    return re.findall(r"<script[^>]*>", text)


def test_self_contained_with_findings_and_figures(tmp_path):
    out = write_html(_report(), tmp_path / "sub" / "report.html")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    # plotly.js inlined exactly once, nothing loaded from the network
    assert len(text) > 1_000_000
    assert text.count("plotly.js v") >= 1 or "Plotly" in text
    assert not any("src=" in s for s in _scripts(text))
    assert not re.search(r"<(script|link)[^>]+(src|href)=['\"]https?://", text)
    # the figures: step timeline, memory breakdown (+ per unit), communication per unit, unit waits
    assert text.count("Plotly.newPlot") >= 5
    for title in ("Step timeline", "Memory at the peak", "Collectives per unit", "Memory per unit"):
        assert title in text
    assert "<h2>FSDP units</h2>" in text and "unreadable" not in text  # every section of the report read
    # the finding, escaped, with its code and prediction
    assert "ac.recommended" in text and "Checkpoint &lt;blocks&gt; &amp; co." in text
    assert "apply_activation_checkpointing(model)" in text
    assert "110.0 ms → 130.0 ms" in text and "24.00 MiB → 10.00 MiB" in text
    # the embedded report cannot close its script tag early
    body = text.split("id='fsdp-doctor-report'>", 1)[1].split("</script>", 1)[0]
    assert json.loads(body.replace("<\\/", "</"))["findings"][0]["code"] == "ac.recommended"


def test_healthy_and_missing_sections(tmp_path):
    r = _report(findings=[])
    text = render_html(r)
    assert "Healthy: no findings." in text
    info = [{"code": "prefetch.exposed_allgather", "severity": "info", "title": "t", "evidence": {},
             "recommendation": {"text": "x", "code": ""}}]
    text = render_html(_report(findings=info))
    assert "No warnings; 1 note below" in text and "Healthy" not in text  # a note is not "healthy"
    bare = render_html({"run": {"path": "p"}})
    assert "Healthy: no findings." in bare and "No memory measurements" in bare and "No step records" in bare
    assert "Plotly.newPlot" not in bare


def test_sample_run_report(sample_run_path, tmp_path):
    rep = json.loads((sample_run_path / "report.json").read_text())
    out = write_html(rep, tmp_path / "sample.html")
    text = out.read_text()
    assert "Step timeline" in text and "Collectives per unit" in text
    assert not re.search(r"<(script|link)[^>]+(src|href)=['\"]https?://", text)


def test_cli_writes_html(sample_run_path, tmp_path):
    from fsdp_doctor.cli import main

    out = tmp_path / "r.html"
    rc = main(["analyze", str(sample_run_path), "--html", str(out)])
    assert rc in (0, 3)
    assert out.exists() and "fsdp-doctor report" in out.read_text()


def test_basic_plotly_bundle_when_installed_else_the_full_one(tmp_path, monkeypatch):
    """The report draws only bars and scatters: plotly.js's basic bundle (installed by `make setup` from npm) is
    inlined when its version is plotly.py's; otherwise, or with another version, the full bundle."""
    from plotly.offline import get_plotlyjs_version

    from fsdp_doctor.present import html as H

    ver = get_plotlyjs_version()
    fake = tmp_path / "plotly-basic.min.js"
    fake.write_text(f"/**\n* plotly.js (basic - minified) v{ver}\n*/\nwindow.FAKE_BASIC_BUNDLE=1;</script>x")
    monkeypatch.setattr(H.sys, "prefix", str(tmp_path / "no-venv"))  # ignore a bundle installed in this venv
    monkeypatch.setenv(H.PLOTLYJS_ENV, str(fake))
    text = render_html(_report())
    assert text.count("FAKE_BASIC_BUNDLE") == 1 and len(text) < 200_000  # inlined once; no full bundle
    assert "<\\/script>x" in text  # the bundle cannot close its script tag early
    assert text.count("Plotly.newPlot") >= 5
    fake.write_text("/**\n* plotly.js (basic - minified) v0.0.1\n*/\nwindow.FAKE_BASIC_BUNDLE=1;")
    text = render_html(_report())
    assert "FAKE_BASIC_BUNDLE" not in text and len(text) > 1_000_000 and f"plotly.js v{ver}" in text
