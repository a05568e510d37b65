"""Data flows one way: record → store → analyze → diagnose → present. Presenters (``fsdp_doctor/present``) and
the dashboard (``dashboards/``) format a report and never compute one: they import no analysis and no rule; the
dashboard gets its report from the pipeline; the live TensorBoard writer calls the trace engine, not the
pipeline. Read from the source (every import statement, those inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdp_doctor

PKG = Path(fsdp_doctor.__file__).resolve().parent
ROOT = PKG.parent
ANALYSIS = ("fsdp_doctor.analyze", "fsdp_doctor.diagnose", "fsdp_doctor.trace.analysis")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT / "dashboards") if ROOT / "dashboards" in path.parents else None
    if rel is not None:  # dashboards/ installs as fsdp_doctor.dashboards
        parts = ["fsdp_doctor", "dashboards", *rel.with_suffix("").parts]
    else:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(p for p in parts if p != "__init__")


def imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every import in the file, relative ones resolved; name "" for ``import x``."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out += [(base, a.name) for a in node.names]
    return out


def _computes(module: str, name: str) -> bool:
    full = f"{module}.{name}" if name else module
    if any(full == a or full.startswith(a + ".") for a in ANALYSIS):
        return True
    return module == "fsdp_doctor.trace" and name.startswith("analyze")  # the trace engine's analyses


def _files(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.rglob("*.py"))


def test_resolves_relative_imports():
    got = imports(ROOT / "dashboards" / "pages" / "overview.py")
    assert ("fsdp_doctor.dashboards.state", "RECORD_SECTIONS") in got
    assert ("fsdp_doctor.dashboards.pages.common", "Filters") in got
    assert ("fsdp_doctor.present.figures", "verdict_figure") in got


def test_presenters_and_dashboard_compute_nothing():
    files = _files(PKG / "present", ROOT / "dashboards")
    assert len(files) > 15
    bad = [f"{p.relative_to(ROOT)}: {m}{'.' + n if n else ''}" for p in files for m, n in imports(p) if _computes(m, n)]
    assert not bad, bad


def test_presenters_format_a_given_report():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in _files(PKG / "present") for m, _ in imports(p)
           if m == "fsdp_doctor.pipeline" or m.startswith("fsdp_doctor.dashboards")]
    assert not bad, bad


def test_dashboard_gets_its_report_from_the_pipeline():
    got = imports(ROOT / "dashboards" / "state.py")
    assert ("fsdp_doctor.pipeline", "build_report") in got


def test_live_tensorboard_writer_calls_the_trace_engine_not_the_pipeline():
    for p in (PKG / "record" / "tensorboard.py", PKG / "tensorboard_scalars.py"):
        mods = {m for m, _ in imports(p)}
        assert "fsdp_doctor.pipeline" not in mods and not any(m.startswith(ANALYSIS[:2]) for m in mods), p
    assert ("fsdp_doctor.trace", "analyze_windows") in imports(PKG / "tensorboard_scalars.py")
