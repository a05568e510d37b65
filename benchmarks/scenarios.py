"""The finding-by-scenario table: the scenario matrix (tests/scenario_matrix.py, the same table and runner as the
tests) run whole, then per rule: the scenarios and model trees it was planted on, recall (found at its severity /
planted), false alarms (a warning of the rule on a row that did not plant it: tuned baselines, other rows), and its
fix applied and rechecked (gone or improved, no new warning, peak predicted against measured; step time
predicted against measured, noisy on a shared host). Rules whose problem needs a GPU (comm.*, kernels.*,
offload.*, memory.alloc_retries, memory.growing) are found from known answers: GPU traces (tests/test_trace_rules.py,
tests/test_kernel_rules.py, shared/reference_traces/hta) and constructed records (tests/test_diagnose_rules.py), and
their snippets executed on a model tree (tests/test_clients.py); their rerun is
for the GPU machine: the matrix's GPU rows (tests/scenario_matrix.py GPU_ROWS), which plant them where a GPU sets
the step, run there with ``--device cuda`` (2 NCCL ranks on the machine's GPUs, sharing one through NCCL_HOSTID),
their fixes applied and rechecked as the CPU rows' are, step-time gains included.

    .venv/bin/python benchmarks/scenarios.py [--markdown] [--out DIR]   (about 4 minutes on 2 cores)
    python benchmarks/scenarios.py --device cuda [--rows gpu|all] [--only ROW,...] [--chunk N] --markdown --table T.md --json RECHECKS.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import scenario_matrix as M  # noqa: E402

MiB = 1 << 20
#: rules planted outside the matrix, on a client's own loop that the matrix's user code does not have: where
ELSEWHERE = {"ac.nested": "a Hugging Face Swin under gradient_checkpointing_enable(), its stages and the blocks inside "
                         "them both checkpointing, each block or each stage a unit (tests/test_ac_nested.py)",
             "checkpoint.blocking": "torchtitan's and a Hugging Face Trainer's saves, and DCP's `save`/`async_save` "
                                    "found unmarked (tests/test_titan_trainer.py, tests/test_recorder_cases.py)",
             "mesh.uncombined_groups": "4 gloo ranks sharded over a (2, 2) mesh's 1-D shard dim "
                                       "(tests/test_mesh_subsets.py)",
             "optim.never_updated": "a Hugging Face Llava whose vision layer after vision_feature_layer=-2 runs for "
                                    "no output (tests/test_never_updated.py)",
             "compile.recompile_limit": "an HF Llama of 10 decoder layers, each compiled in place "
                                        "(tests/test_recompile_limit.py); of 16 with inductor on a GPU "
                                        "(GPU row gpu_hf_llama_recompile_limit)",
             "wrap.reference_one_unit": "TRL 1.16's DPOTrainer, its reference model sharded by TRL as one unit, "
                                        "the fix's reference passed to a new DPOTrainer (tests/test_trl.py)",
             "jitter.level_shift": "four 40-step 2-rank runs whose step time changes at step 20 and stays (longer "
                                   "sequences, a slower loader, a thread on one rank) or grows 3 ms every step "
                                   "(tests/fixtures/level_shift, tests/test_level_shift.py)"}
HEADER = ["rule", "planted on", "recall", "false alarms", "fix applied and rechecked", "peak pred / meas",
          "step ms pred / meas"]


def _mib(b) -> str:
    return "-" if b is None else f"{b / MiB:.2f}"


def _gpu_found() -> tuple[dict[str, set[str]], set[str]]:
    """({rule: the known-answer tests and traces it fires on}, the rules among them that print a fix there): the
    known-answer tests run with Rule.finding observed, as tests/test_clients.py collects their snippets."""
    import contextlib
    import io

    from test_clients import _known_answer_findings

    got: dict[str, set[str]] = {}
    with contextlib.redirect_stdout(io.StringIO()):  # the tests' own prints
        found, coded = _known_answer_findings(), _known_answer_findings(snippets=True)
    for test, code in found:
        got.setdefault(code, set()).add(test)
    return got, {t[1] for t in coded}


def table(outcomes: dict[str, M.Outcome], gpu: dict[str, set[str]], coded: set[str],
          planted_only: bool = False, device: str = "cpu") -> list[list[str]]:
    """One row per rule (``planted_only``: the rules the outcomes' rows planted); on ``device`` "cuda" the GPU
    rows' step-time gains are measured ones."""
    from fsdp_doctor.diagnose import RULES

    rows = []
    for rule in sorted(RULES, key=lambda r: r.code):
        code = rule.code
        planted = [o for o in outcomes.values() if o.row.code == code and not o.error]
        if planted_only and not any(o.row.code == code for o in outcomes.values()):
            continue
        if not planted and code not in ELSEWHERE and (code.startswith(M.GPU_ONLY) or code in gpu):
            traces = sorted(gpu.get(code, ()))
            rows.append([code, f"known answers ({len(traces)})" if traces else "-",
                         f"found in {len(traces)}" if traces else "-", "-",
                         "rerun: on the GPU machine (snippet executed on a model tree)" if code in coded else
                         "no fix code (advice in words)", "-", "-"])
            continue
        others = [o for o in outcomes.values() if o.row.code != code and not o.error]
        base = sum(1 for o in others if o.row.code is None and code in M.warnings_of(o.findings))
        other = sum(1 for o in others if o.row.code is not None and code in M.warnings_of(o.findings))
        if not planted:
            rows.append([code, ELSEWHERE.get(code, "not planted"), "-", f"{base} baseline, {other} other",
                         "rerun there" if code in ELSEWHERE else "-", "-", "-"])
            continue
        trees = sorted({o.row.tree for o in planted})
        found = sum(1 for o in planted if o.finding is not None)
        fixes = [o for o in planted if o.after is not None]
        checks = [o.recheck() for o in fixes]
        if fixes:
            gone = sum(1 for c in checks if c["gone"])
            improved = sum(1 for c in checks if not c["gone"] and c["improved"])
            new = sorted({w for c in checks for w in c["new_warnings"]})
            gpu_gain = [o for o in fixes if o.row.gpu_gain]
            wrong = [o.row.name for o in fixes if o.row.name in M.KNOWN_WRONG]
            fix = (f"{len(fixes)} applied: {gone} gone" + (f", {improved} improved" if improved else "")
                   + (f", new warning {', '.join(new)}" if new else ", no new warning")
                   + (f"; its gain for a GPU to recheck ({len(gpu_gain)})" if gpu_gain and device != "cuda" else "")
                   + "".join(f"; {o.row.name} gain ok: {o.recheck()['gain_ok']}" for o in gpu_gain
                             if device == "cuda")
                   + (f"; advice wrong: {', '.join(wrong)}" if wrong else ""))
            peaks = [(c["peak_predicted"], c["peak_measured"], c.get("peak_at_most")) for c in checks
                     if c["peak_predicted"]]
            peak = "; ".join(f"{'≤' if most else ''}{_mib(p)}/{_mib(m)} MiB ({100 * (m - p) / p:+.0f}%)"
                             for p, m, most in peaks) or "-"
            steps = [(c["step_ms_predicted"], c["step_ms_measured"]) for c in checks if c["step_ms_predicted"]]
            step = "; ".join(f"{p:.0f}/{m:.0f}" for p, m in steps) or "-"
        else:
            errors = [o.after_error.splitlines()[0] for o in planted if o.after_error]
            fix = ("rerun failed: " + errors[0]) if errors else \
                "no fix code (what differs on that rank is for the user to find)" if code.startswith("straggler.") \
                else "no fix code" if found else "-"
            peak = step = "-"
        rows.append([code, f"{len(planted)}: {', '.join(trees)}", f"{found}/{len(planted)}",
                     f"{base} baseline, {other} other", fix, peak, step])
    return rows


def render(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
        return "\n".join(out)
    out = []
    for r in rows:  # one rule per paragraph: fits a terminal
        out.append(f"{r[0]}  planted {r[1]}  recall {r[2]}  false alarms {r[3]}")
        out.append(f"    fix: {r[4]}")
        if r[5] != "-" or r[6] != "-":
            out.append(f"    peak predicted/measured {r[5]}; step ms predicted/measured {r[6]}")
    return "\n".join(out)


def rechecks(outcomes: dict[str, M.Outcome], device: str) -> dict:
    """Per row: what was planted, what was found, the fix and its recheck, and what is wrong (M.problems)."""
    out = {}
    for name, o in outcomes.items():
        out[name] = {"tree": o.row.tree, "planted": o.row.code, "why": o.row.why, "device": device,
                     "found": None if o.finding is None else o.finding.severity,
                     "findings": {f.code: f.severity for f in o.findings},
                     "fix": o.fix, "recheck": o.recheck(), "after_findings": {f.code: f.severity for f in
                                                                             o.after.findings} if o.after else None,
                     "rerun_note": o.rerun_note, "retried": o.retried, "problems": M.problems(o), "ok": not M.problems(o)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="a markdown table (the README's)")
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: 2 NCCL ranks on the GPU(s); the GPU rows' rules then fire (default cpu: gloo)")
    ap.add_argument("--rows", choices=("cpu", "gpu", "all"),
                    help="the matrix's CPU rows, its GPU rows or both (default: cpu on the CPU, gpu with --device "
                         "cuda); GPU rows on the CPU run shrunk, for their plumbing only")
    ap.add_argument("--only", default="", help="comma-separated row names: run these rows only")
    ap.add_argument("--table", type=Path, help="also write the printed table to this file")
    ap.add_argument("--json", type=Path, help="write every row's finding, fix and recheck here")
    ap.add_argument("--chunk", type=int, default=0, metavar="N",
                    help="run the rows N at a time (their runs, then their fixes' reruns), writing the table and the "
                         "rechecks after each N: a run cut off keeps the rows it finished (default: all at once)")
    a = ap.parse_args(argv)
    which = a.rows or ("gpu" if a.device == "cuda" else "cpu")
    rows = {"cpu": M.ROWS, "gpu": M.GPU_ROWS, "all": M.ROWS + M.GPU_ROWS}[which]
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in M.BY_NAME]
        if unknown:
            ap.error(f"--only: no row named {', '.join(unknown)}")
        rows = [M.BY_NAME[n] for n in names]
    if not rows or a.chunk < 0:
        ap.error(f"--chunk: {a.chunk} rows at a time" if rows else "--only: no row named")
    n = a.chunk or len(rows)
    outcomes: dict[str, M.Outcome] = {}
    with tempfile.TemporaryDirectory() as d:
        for i in range(0, len(rows), n):
            outcomes.update(M.run_matrix(a.out or Path(d), rows[i:i + n], device=a.device))
            text = summary(outcomes, which, a.device, a.markdown, [r.name for r in rows[i + n:]])
            if a.table:
                a.table.write_text(text + "\n")
            if a.json:
                a.json.write_text(json.dumps(rechecks(outcomes, a.device), indent=1, default=str))
        print(text)
    return 0


def summary(outcomes: dict[str, M.Outcome], which: str, device: str, markdown: bool, left: list[str]) -> str:
    """The table of the rows run so far, and a line saying what ran (and which rows are still to run)."""
    failed = [f"{o.row.name}: {o.error.splitlines()[0]}" for o in outcomes.values() if o.error]
    # the known-answer GPU traces stand in for the GPU rows only where they did not run
    found = _gpu_found() if which == "cpu" else ({}, set())
    text = render(table(outcomes, *found, planted_only=which == "gpu", device=device), markdown)
    baselines = [o for o in outcomes.values() if o.row.code is None and not o.error]
    reruns = sum(1 for o in outcomes.values() if o.after is not None or o.after_error)
    again = [o.row.name for o in outcomes.values() if o.retried]
    worlds = sorted({o.row.world for o in outcomes.values()})
    return (text + f"\n\n{len(outcomes)} scenarios ({len(baselines)} tuned baselines, "
            f"{len({o.row.tree for o in outcomes.values()})} model trees) and {reruns} reruns, "
            f"{' or '.join(map(str, worlds))} {'NCCL' if device == 'cuda' else 'gloo'} ranks"
            + (f"; failed to run: {'; '.join(failed)}" if failed else "")
            + (f"; ran again, their first rerun's peak off the prediction: {', '.join(again)}" if again else "")
            + (f"; not run yet: {', '.join(left)}" if left else ""))


if __name__ == "__main__":
    sys.exit(main())
