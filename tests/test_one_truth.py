"""One truth per figure, in every view, on real traces: the recorded gloo sample, real GPU traces (HTA's reference
set, read from ../shared when present), a gloo reference trace, and an 8-rank known-answer GPU trace set with Hugging
Face-style unit names. Exposed communication is per step (never a window sum), never longer than the step, equal to
the verdict's communication share of that step; no share over 100%; the verdict names its runner-up by group; and
the terminal (80, 100 and 200 columns), the JSON, the HTML, the dashboard's overview and the TensorBoard scalars show
the same figures. The terminal fits its width: no line wider, no number cut, the findings' headlines on the first
screen, fixes printed as plain code."""

from __future__ import annotations

import html as htmllib
import json
import re
import statistics
from pathlib import Path

import pytest
from rich.console import Console

from conftest import HTA_TRACES, SAMPLE_RUN
from fsdp_doctor.pipeline import build_report
from fsdp_doctor.present.fmt import comm_headline, fmt_ms, short_unit_labels, verdict_headline
from fsdp_doctor.present.terminal import render_report
from fsdp_doctor.report_sections import Report
from fsdp_doctor.store import load_run
from trace_fixtures import gpu_known_trace

HTA_CASES = ("a100_rank3_of_8", "a100_sendrecv_2rank", "v100_rank1_of_2", "cpu_only_gloo")
WIDTHS = (80, 100, 200)


def _hf_gpu_folder(root: Path, ranks: int = 8) -> Path:
    """``ranks`` known-answer GPU traces whose units carry Hugging Face names (``model.layers.N``)."""
    root.mkdir(parents=True, exist_ok=True)
    for k in range(ranks):
        b = gpu_known_trace(rank=k)
        for e in b.events:
            if "layers." in e["name"]:
                e["name"] = e["name"].replace("layers.", "model.layers.")
        b.write(root / f"rank{k}.json")
    return root


def _cases():
    out = [pytest.param("sample", id="sample"), pytest.param("hf8", id="known-gpu-8-ranks-hf-names")]
    for name in HTA_CASES:
        out.append(pytest.param(name, id=name, marks=pytest.mark.skipif(not (HTA_TRACES / name).is_dir(),
                                                                         reason="reference traces not found")))
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            if name == "sample":
                path = SAMPLE_RUN
            elif name == "hf8":
                path = _hf_gpu_folder(tmp_path_factory.mktemp("hf8"))
            else:
                path = HTA_TRACES / name
            cache[name] = (path, build_report(load_run(path)))
        return cache[name]

    return get


def _terminal(report: Report, width: int) -> str:
    c = Console(width=width, record=True, color_system=None, file=open("/dev/null", "w"))
    render_report(report, c)
    return c.export_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", _cases())
def test_one_definition_per_figure(reports, name):
    """Per rank: exposed ≤ communication ≤ step, all per complete step; the verdict's step is the trace's step and
    its communication share of it is the exposed figure; report.comm is the median over ranks of those figures; no
    share over 100%; the runner-up named is the second group (communication's parts added up)."""
    _, rep = reports(name)
    ov, v = rep.overlap, rep.verdict
    assert ov is not None and v is not None and rep.comm is not None
    exposed = {}
    for r, pr in ov.per_rank.items():
        assert pr.step_count >= 1 and pr.step_ms > 0
        assert 0 <= pr.exposed_ms_per_step <= pr.comm_ms_per_step + 1e-9 <= pr.step_ms + 1e-9, (r, pr)
        assert pr.hidden_ms_per_step == pytest.approx(pr.comm_ms_per_step - pr.exposed_ms_per_step, abs=1e-9)
        for pct in (pr.overlap_pct, pr.step_overlap_pct):
            assert pct is None or 0 <= pct <= 100
        ve = v.per_rank[r]
        assert ve.step_ms == pytest.approx(pr.step_ms, abs=1e-3)
        # the verdict's shares are rounded to 0.01 point of the step
        assert ve.groups_pct["communication"] / 100 * pr.step_ms == pytest.approx(pr.exposed_ms_per_step,
                                                                                 abs=1e-4 * pr.step_ms + 1e-6)
        exposed[r] = pr.exposed_ms_per_step
        for row in (u for u in ov.per_unit if str(u.rank) == r):  # a row's calls as a union inside the steps
            assert row.steps == pr.step_count
            assert row.exposed_ms_per_step <= row.comm_ms_per_step + 1e-9 <= pr.comm_ms_per_step + 2e-9
            assert row.exposed_ms_per_step <= pr.exposed_ms_per_step + 1e-9
    # a run known only from its traces: its step times are the complete ProfilerSteps, which add up to the window
    if rep.steps is None:
        for r, pr in ov.per_rank.items():
            st = rep.trace_steps.per_rank[r]
            assert st.count == pr.step_count and st.mean_ms == pytest.approx(pr.step_ms, abs=1e-3)
    else:
        assert rep.trace_steps is None  # the records' steps are the steps
    assert rep.comm.source == "trace"
    assert rep.comm.exposed_ms_per_step == pytest.approx(statistics.median(exposed.values()), abs=1e-3)
    for entry in (v.job, *v.per_rank.values()):
        assert all(0 <= x <= 100 for x in (*entry.shares_pct.values(), *entry.groups_pct.values()))
        assert sum(entry.groups_pct.values()) == pytest.approx(100, abs=0.05)
        ranked = sorted(entry.groups_pct.values(), reverse=True)
        if "; then " in entry.summary and ranked[1] >= 0.5:
            first = re.search(r"(\d+)%", entry.summary.split("; then ", 1)[1]).group(1)
            assert int(first) == round(ranked[1]), entry.summary


@pytest.mark.parametrize("name", _cases())
def test_every_view_shows_the_same_figures(reports, name, tmp_path):
    """Terminal, JSON, HTML, the dashboard's overview and the TensorBoard scalars: the same exposed communication,
    verdict sentence, per-rank step and per-step communication."""
    from fsdp_doctor.present.html import write_html
    from fsdp_doctor.tensorboard_scalars import overlap_scalars

    path, rep = reports(name)
    head, vhead = comm_headline(rep.comm), verdict_headline(rep.verdict)
    # JSON: the same report back
    back = Report.of(json.loads(json.dumps(rep.to_builtins())))
    assert back.comm == rep.comm and back.verdict == rep.verdict and back.overlap.per_rank == rep.overlap.per_rank
    # terminal
    term = _flat(_terminal(rep, 100))
    assert _flat(head) in term and _flat(vhead) in term
    wide = _terminal(rep, 200)
    if rep.trace_steps is not None:
        assert "Step time per rank, ms (the traces' complete profiler steps" in _flat(wide)
        from fsdp_doctor.present.fmt import fmt_ms_cell as _num

        for r, st in rep.trace_steps.per_rank.items():
            assert any(ln.split()[:3] == [r, str(st.count), _num(st.p50_ms)] for ln in wide.splitlines()), r
    for r, pr in rep.overlap.per_rank.items():
        row = next(ln for ln in wide.splitlines() if ln.split()[:2] == [r, pr.device])
        for x in (pr.step_ms, pr.comm_ms_per_step, pr.exposed_ms_per_step):
            assert fmt_ms(x) in row, (r, row)
    # HTML
    out = write_html(rep, tmp_path / "r.html")
    text = htmllib.unescape(out.read_text())
    assert head in text and vhead in text
    for r, pr in rep.overlap.per_rank.items():  # (the terminal's columns: tests/test_html.py checks every cell)
        assert f"<td class=l>{r}</td><td>{pr.device}</td><td>{pr.step_count or '–'}</td><td>{fmt_ms(pr.step_ms)}</td>" \
               f"<td>{fmt_ms(pr.comm_ms_per_step)}</td><td>{fmt_ms(pr.hidden_ms_per_step)}</td>" \
               f"<td>{fmt_ms(pr.exposed_ms_per_step)}</td>" in out.read_text()
    # TensorBoard: a window's per-step scalars are the report's
    for r, pr in rep.overlap.per_rank.items():
        if len([f for f in rep.overlap.files]) == len(rep.overlap.per_rank):  # one window per rank
            vals = overlap_scalars(rep.overlap, int(r))
            assert vals and all(x["overlap/exposed_comm_ms"] == pr.exposed_ms_per_step for x in vals.values())
    # dashboard: the overview of the same folder
    if name in ("sample", "hf8", "cpu_only_gloo"):
        from fsdp_doctor.dashboards.pages import PAGES
        from fsdp_doctor.dashboards.pages.common import Filters
        from fsdp_doctor.dashboards.state import RunState

        st = RunState(path, background_traces=False)
        st.refresh()
        snap = st.snapshot()
        assert Report.of(snap.report).comm == rep.comm
        page = json.dumps([c.to_plotly_json() for c in PAGES["overview"][1].layout(snap, Filters())],
                          default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o),
                          ensure_ascii=False)
        assert vhead in page and f"{fmt_ms(rep.comm.exposed_ms_per_step)} / step" in page
        # and the Communication page's Exposed tile: the headline's figure, per step, the median over ranks (it gave
        # the sum over ranks of the whole windows, twice the headline on 2 ranks: a new-user trial)
        if rep.comm.source == "trace" and rep.overlap is not None and len(rep.overlap.per_rank) > 1:
            comm = json.dumps([c.to_plotly_json() for c in PAGES["communication"][1].layout(snap, Filters())],
                              default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o),
                              ensure_ascii=False)
            med = statistics.median(pr.exposed_ms_per_step for pr in rep.overlap.per_rank.values())
            assert fmt_ms(med) in comm and "per step, median over" in comm, comm[:3000]


@pytest.mark.parametrize("name", ["sample", "hf8", pytest.param("a100_sendrecv_2rank", marks=pytest.mark.skipif(
    not (HTA_TRACES / "a100_sendrecv_2rank").is_dir(), reason="reference traces not found"))])
@pytest.mark.parametrize("width", WIDTHS)
def test_terminal_fits_its_width(reports, name, width):
    """No line wider than the console; no number cut short ("108…"); unit names whole and short (``layers.1``,
    not ``model.layer…``); the findings' headlines within the first screen; at 200 columns the width is used;
    a fix prints as plain code (a copy pastes as Python)."""
    _, rep = reports(name)
    text = _terminal(rep, width)
    lines = text.splitlines()
    code = {ln for f in rep.findings for ln in f.recommendation.code.splitlines()}
    # a fix's code line is printed whole (the terminal wraps it on screen; a copy pastes one line)
    assert max(len(ln) for ln in lines if ln not in code) <= width
    assert not re.search(r"\d…|…\s*\d|\d\.…", text), [ln for ln in lines if "…" in ln]
    assert "model.layer…" not in text
    tables = text.split("─ Diagnosis ─")[0]
    if name == "hf8":  # the tables name units by their shortest unambiguous suffix (evidence keeps full names)
        assert "layers.0" in tables and "model.layers" not in tables
    assert not re.search(r"\d[eE][+-]\d", text), "a number in exponent notation (no unit)"
    if rep.units:
        assert any(ln.split()[:1] == ["unit"] for ln in lines), "the unit column is shown"
        # every unit's name whole, nested ones with their indent counted (at 80 columns "  embed_tokens" was folded
        # into "  embed_toke" / "ns")
        for label in short_unit_labels([u.name for u in rep.units]).values():
            for part in label.split(", "):
                assert re.search(rf"(^|\s){re.escape(part)}(,|\s|$)", tables, re.M), (width, part)
    first_screen = "\n".join(lines[:50])
    for f in rep.findings:
        assert f"{f.code}: {f.title}"[:30] in _flat(first_screen), f.code
    if width == 200:
        assert max(len(ln) for ln in lines) > 100
    for f in rep.findings:
        if f.recommendation.code:
            for code_line in f.recommendation.code.splitlines():
                assert code_line in lines, code_line  # the line itself, no border or margin around it


def test_short_unit_labels():
    names = ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm, lm_head", "vision.layers.0"]
    got = short_unit_labels(names)
    assert got == {"": "(root)", "model.embed_tokens": "embed_tokens", "model.layers.0": "model.layers.0",
                   "model.layers.1": "layers.1", "model.norm, lm_head": "norm, lm_head",
                   "vision.layers.0": "vision.layers.0"}
    # a grouped unit of more than two modules (fully_shard(list(experts))): its first and last, and how many (the
    # whole list wrapped to column 0 at 80 columns, out of the tree: a new-user trial)
    experts = ", ".join(f"layers.0.moe.experts.{i}" for i in range(4))
    assert short_unit_labels(["", experts, "layers.1.moe.experts.0"])[experts] == \
        "layers.0.moe.experts.0, … experts.3 (4 modules)"
    # never from an index: a diffusers UNet's attention units read "0.attentions.0" and "1.attentions.0", their
    # blocks' names dropped
    unet = ["", "down_blocks.0.attentions.0", "down_blocks.1.attentions.0", "mid_block.attentions.0",
            "up_blocks.1.attentions.0", "up_blocks.1.attentions.1"]
    assert short_unit_labels(unet) == {"": "(root)", **{n: n for n in unet[1:-1]}, unet[-1]: "attentions.1"}
    # units inside wrappers by their module path (accelerate's FSDP2 plugin shards each layer inside its
    # checkpoint_wrapper, then the wrapper: "0._checkpoint_wrapped_module" dropped the layer's name, a new-user trial),
    # the wrapper's own unit as the call that made it
    wrapped = [f"model.layers.{i}._checkpoint_wrapped_module" for i in range(2)]
    assert short_unit_labels(["", *wrapped, "model.norm, lm_head"]) == {
        "": "(root)", wrapped[0]: "layers.0", wrapped[1]: "layers.1", "model.norm, lm_head": "norm, lm_head"}
    assert short_unit_labels(["model.layers.0", wrapped[0], "layers.1._orig_mod"]) == {
        "model.layers.0": "checkpoint_wrapper(layers.0)", wrapped[0]: "layers.0", "layers.1._orig_mod": "layers.1"}


def test_run_facts_from_the_traces_own_metadata(tmp_path):
    """A folder of plain traces: backend, world size, GPU model and the files' ranks from ``distributedInfo`` and
    ``deviceProperties`` (the file's head only), shown in the header; NCCL's version where torch wrote it."""
    import gzip
    import shutil

    from fsdp_doctor.analyze.report import run_facts
    from fsdp_doctor.trace.meta import read_meta

    run = tmp_path / "plain"
    shutil.copytree(SAMPLE_RUN / "profiler", run)
    facts = run_facts(load_run(run))
    assert (facts.backend, facts.world_size, facts.trace_ranks, facts.facts_source) == ("gloo", 2, [0, 1],
                                                                                        "trace metadata")
    # a GPU trace as torch writes it: metadata first, NCCL's version in distributedInfo
    (tmp_path / "gpu").mkdir()
    gpu_known_trace(rank=3).write(tmp_path / "gpu" / "rank3.json")
    body = json.loads((tmp_path / "gpu" / "rank3.json").read_text())
    meta = {"schemaVersion": 1, "deviceProperties": [{"id": i, "name": "NVIDIA H100 80GB HBM3"} for i in range(8)],
            "distributedInfo": {"backend": "nccl", "rank": 3, "world_size": 8, "nccl_version": "2.21.5"}}
    with gzip.open(tmp_path / "gpu" / "rank3.json.gz", "wt") as f:
        json.dump({**meta, **{k: v for k, v in body.items() if k not in meta}}, f)  # metadata first
    (tmp_path / "gpu" / "rank3.json").unlink()
    assert read_meta(tmp_path / "gpu" / "rank3.json.gz").distributedInfo.nccl_version == "2.21.5"
    rep = build_report(load_run(tmp_path / "gpu"))
    f = rep.run
    assert (f.backend, f.world_size, f.device_name, f.nccl_version, f.trace_ranks) == (
        "nccl", 8, "NVIDIA H100 80GB HBM3", "2.21.5", [3])
    head = _flat(_terminal(rep, 200))
    assert "8 ranks · nccl · NVIDIA H100 80GB HBM3 · NCCL 2.21.5 · traces of rank 3 · read from the trace metadata" in head
    assert Report.of(json.loads(json.dumps(rep.to_builtins()))).run == rep.run
    if (HTA_TRACES / "a100_rank3_of_8").is_dir():
        f = run_facts(load_run(HTA_TRACES / "a100_rank3_of_8"))
        assert (f.backend, f.world_size, f.device_name, f.trace_ranks) == ("nccl", 8, "NVIDIA A100-PG509-200", [3])


@pytest.mark.parametrize("name", _cases())
def test_unit_and_memory_figures_agree_in_every_view(reports, name, tmp_path):
    """Each unit's own forward and backward (``fwd_self_ms``/``bwd_self_ms``: the records', else the trace's FSDP2
    labels) and each rank's peak memory (the records', else the trace's [memory] events) are the same figures in
    the terminal, the HTML and the dashboard's Units and Memory pages; a source without them shows none."""
    from fsdp_doctor.present.fmt import fmt_bytes
    from fsdp_doctor.present.html import write_html
    from fsdp_doctor.present.fmt import fmt_ms_cell as _num

    path, rep = reports(name)
    units, mem = rep.unit_rows(), rep.memory_section()
    if name.startswith(("a100", "v100", "cpu_only")):  # HTA's traces carry no FSDP2 labels
        assert units == []
    term = _terminal(rep, 200)
    html = htmllib.unescape(write_html(rep, tmp_path / "r.html").read_text())
    labels = short_unit_labels(u.name for u in units)
    for u in units[:20]:
        t = u.timing_p50
        row = next(ln for ln in term.splitlines() if ln.split()[:len(labels[u.name].split())] == labels[u.name].split())
        assert _num(t.fwd_self_ms) in row.split() and _num(t.bwd_self_ms) in row.split(), (u.name, row)
        assert all(fmt_ms(x) in html for x in (t.fwd_self_ms, t.bwd_self_ms) if x is not None)
    for r, m in (mem.per_rank.items() if mem else ()):
        assert fmt_bytes(m.peak_bytes) in term and fmt_bytes(m.peak_bytes) in html
    if name not in ("sample", "hf8", "cpu_only_gloo"):
        return
    from fsdp_doctor.dashboards.pages import PAGES
    from fsdp_doctor.dashboards.pages.common import Filters
    from fsdp_doctor.dashboards.state import RunState

    st = RunState(path, background_traces=False)
    st.refresh()
    snap = st.snapshot()

    def grid(key, tid):
        def walk(c):
            if getattr(c, "id", None) == tid:
                return c
            kids = getattr(c, "children", None)
            for k in kids if isinstance(kids, (list, tuple)) else [kids] if kids is not None else []:
                got = walk(k)
                if got is not None:
                    return got
            return None
        return next((g for g in map(walk, PAGES[key][1].layout(snap, Filters())) if g is not None), None)

    tbl = grid("units", "tbl-units")
    assert (tbl is None) == (not units)
    for u, row in zip(units, tbl.rowData if units else (), strict=True):  # the root's forward is its own time, as elsewhere
        assert (row["fwd"], row["bwd"]) == (fmt_ms(u.timing_p50.fwd_self_ms), fmt_ms(u.timing_p50.bwd_self_ms)), u.name
    if mem is not None:
        page = json.dumps([c.to_plotly_json() for c in PAGES["memory"][1].layout(snap, Filters())],
                          default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o),
                          ensure_ascii=False)
        assert fmt_bytes(max(m.peak_bytes for m in mem.per_rank.values())) in page



def test_a_nested_name_keeps_its_indent_and_its_word_whole():
    """The units table of a Hugging Face run at 80 columns, a nested unit's name indented by two: the narrowest its
    column may get counts the indent before the first word, so a column is left out instead ("  embed_tokens" was
    folded into "  embed_toke" / "ns")."""
    import io

    from fsdp_doctor.present.fit import Col, fitted_table

    cols = [Col("unit", justify="left", wrap=True), Col("params", drop=2), Col("shard", drop=3),
            Col("gathered", drop=1), Col("reshard", drop=2), Col("AC", drop=3), Col("fwd"), Col("AG wait"),
            Col("bwd"), Col("AG wait")]
    rows = [["(root)", "0.00 M", "0 B", "0 B", "false", "none", "1.72", "0.14", "—", "0.00"],
            ["  embed_tokens", "0.03 M", "64.00 KiB", "128.00 KiB", "true", "none", "6.24", "6.03", "0.45", "0.29"],
            ["  layers.0", "0.04 M", "72.25 KiB", "144.50 KiB", "false", "none", "5.45", "3.85", "3.77", "2.29"]]
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(fitted_table("FSDP units", cols, rows, 80))
    text = out.getvalue()
    assert "  embed_tokens " in text and "embed_toke\n" not in text, text
    assert max(len(ln) for ln in text.splitlines()) <= 80 and "not shown at 80 columns" in text, text


def test_the_exposure_table_labels_units_among_all_the_runs_units():
    """An MoE's exposure table showed "experts.2" where both layers have an experts.2, the other layer's not among the
    table's rows (a new-user trial): the labels are unambiguous among every unit of the run."""
    from rich.console import Console

    from fsdp_doctor.present.overlap import render_overlap
    import msgspec

    from fsdp_doctor.report_sections import OverlapSection

    row = {"rank": 0, "unit": "model.layers.0.mlp.experts.2", "collective": "all_gather", "phase": "forward",
           "count": 1, "comm_us": 1000.0, "exposed_us": 500.0}
    sec = msgspec.convert({"per_rank": {"0": {"comm_us": 1000.0, "exposed_us": 500.0, "overlap_pct": 50.0,
                                              "steps": [1], "device": "cpu"}}, "per_unit": [row]}, OverlapSection)
    def shown(names):
        con = Console(width=120, record=True)
        con.print(render_overlap(sec, names=names))
        return con.export_text()
    assert " experts.2 " in shown([])
    both = shown(["model.layers.0.mlp.experts.2", "model.layers.1.mlp.experts.2"])
    assert "0.mlp.experts.2" in both, both


def test_a_memory_table_too_wide_leaves_a_rank_out_with_its_share(sample_run_path):
    """4 ranks at 80 columns (a new-user trial's HSDP run): the last rank's bytes were left out and its "%" kept,
    headed "rank 2 % %"; a rank's share goes with it, and the caption names the rank alone."""
    import copy
    import io

    from rich.console import Console

    from fsdp_doctor.analyze.memory import analyze_memory
    from fsdp_doctor.present.memory import render_memory
    from fsdp_doctor.store import load_run

    mem = analyze_memory(load_run(sample_run_path))
    first = mem.per_rank[sorted(mem.per_rank)[0]]
    mem.per_rank = {str(r): copy.deepcopy(first) for r in range(4)}
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(render_memory(mem, 80))
    text = out.getvalue()
    header = next(ln for ln in text.splitlines() if ln.strip().startswith("category"))
    assert header.split() == ["category", "rank", "0", "%", "rank", "1", "%", "rank", "2", "%"], header
    assert "not shown at 80 columns: rank 3 (a wider terminal shows them)" in text, text


def test_the_verdict_at_80_columns_leaves_out_a_column_of_zeros_before_a_part_of_the_step():
    """A new-user trial's gradient accumulation without set_requires_gradient_sync(False) (HF Llama, 2 gloo ranks,
    plain traces; the shares below are its report's): at 80 columns the verdict's RS column, 24% of the step and
    the subject of its warning, was left out while offload and idle, 0.0 on every row, were kept. A column of zeros
    goes first."""
    import io

    from fsdp_doctor.present.terminal import render_verdict
    from fsdp_doctor.report_sections import Verdict, VerdictEntry

    def entry(fwd, bwd, rs, compute, host, inp, step_ms=None):
        return VerdictEntry(bound="communication", step_ms=step_ms, shares_pct={
            "compute": compute, "allgather_fwd": fwd, "allgather_bwd": bwd, "reducescatter": rs, "model_comm": 0.0,
            "other_comm": 0.0, "offload": 0.0, "other_gpu": 0.0, "host": host, "sync": 0.0, "input": inp,
            "idle": 0.0})

    v = Verdict(job=entry(19.2, 16.8, 23.7, 28.5, 11.7, 0.1),
                per_rank={"0": entry(21.0, 16.9, 22.9, 28.8, 10.4, 0.0, 961.976),
                          "1": entry(17.4, 16.7, 24.6, 28.2, 13.0, 0.2, 934.946)})
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(render_verdict(v, 80))
    text = out.getvalue()
    header = next(ln for ln in text.splitlines() if ln.split()[:2] == ["rank", "bound"])
    assert header.split()[-4:] == ["RS", "offload", "host", "input"], text
    assert "22.9" in text and "not shown at 80 columns: idle (a wider terminal shows them)" in text, text
    assert max(len(ln) for ln in text.splitlines()) <= 80, text
