"""The terminal rendering of the trace result fits 100 columns and shows units on every number."""

from rich.console import Console

from fsdp_doctor.present.fmt import fmt_bw
from fsdp_doctor.present.overlap import fmt_bytes, fmt_us, render_overlap
from fsdp_doctor.trace import analyze_traces
from trace_fixtures import gloo_known_trace, gpu_known_trace


def _render(result):
    console = Console(width=100, record=True, color_system=None)
    console.print(render_overlap(result))
    return console.export_text()


def test_formatters():
    assert fmt_us(850) == "850 µs" and fmt_us(12_345) == "12.3 ms" and fmt_us(2_500_000) == "2.50 s"
    assert fmt_us(-90, signed=True) == "-90 µs" and fmt_us(50, signed=True) == "+50 µs"
    # one convention (present/fmt.py): binary units for sizes, decimal for bandwidth, µs below a millisecond
    assert fmt_us(None) == "—" and fmt_bytes(4_000_000) == "3.81 MiB" and fmt_bytes(800) == "800 B"
    assert fmt_bw(0.0298) == "29.8 MB/s" and fmt_bw(20.0) == "20 GB/s" and fmt_us(200) == "200 µs"


def test_render_tables(tmp_path):
    gpu_known_trace(rank=0).write(tmp_path / "rank0.json")
    gloo_known_trace(rank=1).write(tmp_path / "rank1.json")
    (tmp_path / "rank2.json").write_text('{"a": 1}')
    for k in range(3, 6):  # more rows than the table shows
        b = gpu_known_trace(rank=k)
        for e in b.events:
            if e["name"].startswith("FSDP::") and "layers.0" in e["name"]:
                e["name"] = e["name"].replace("layers.0", "model.very_long_module_name.layers.0")
        b.write(tmp_path / f"rank{k}.json")
    text = _render(analyze_traces(tmp_path))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "42.0%" in text and "36.4%" in text  # rank 0 GPU, rank 1 gloo (2400 of 6600 µs in collectives)
    assert "20 GB/s" in text and "40 GB/s" in text and "MB" in text and "µs" in text
    assert "top 15 of" in text
    assert "skipped rank2.json: not a Kineto trace (no traceEvents)" in text
    unit_lines = [line for line in lines if " fwd " in line or " bwd " in line]
    assert len(unit_lines) == 15
    # worst exposure first: the gloo rank's fully exposed synchronous all-gathers (2 × 1 ms over its 2 complete
    # steps: one call and 1.00 ms per step)
    assert unit_lines[0].split()[:6] == ["1", "0", "AG", "fwd", "1", "1.00"] and "1.00 ms   1.00 ms" in unit_lines[0]
    assert "0.4 MB/s" in unit_lines[0] and "800 B" in unit_lines[0]


def test_render_empty():
    text = _render({"per_rank": {}, "per_unit": [], "copies": {}, "idle": {}, "blocking": {}, "files": [],
                    "skipped": [{"file": "x", "error": "no such file or directory"}]})
    assert "No traces" in text and "skipped x: no such file or directory" in text


def test_collectives_outside_the_units_name_their_phase_in_full():
    """The per-unit table's op column names a collective no unit issued by where it ran: a gradient norm's
    all-reduce (clip_grad_norm_ on DTensor gradients) read "AR gra" (the phase cut to 3 letters: a new-user trial),
    a model's own parallelism's "AG mod"."""
    from fsdp_doctor.present.overlap import _unit_table
    from fsdp_doctor.report_sections import CommUnitRow

    rows = [CommUnitRow(rank=0, unit=u, collective=c, phase=p, count=1, comm_us=10.0)
            for u, c, p in (("(other)", "all_reduce", "grad_norm"), ("(other)", "all_gather", "model"),
                            ("blocks.0", "all_gather", "forward"), ("(other)", "all_reduce", "optimizer"))]
    console = Console(width=100, record=True)
    console.print(_unit_table(rows, 10, 100))
    ops = [line.split()[2:4] for line in console.export_text().splitlines() if line.strip().startswith("0 ")]
    assert ops == [["AR", "norm"], ["AG", "model"], ["AG", "fwd"], ["AR", "opt"]], ops
