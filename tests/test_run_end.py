"""How a run that ended badly is told: one line, with each rank's last recorded step, in the report's problems,
which the terminal prints and the JSON and the dashboard hold as they are. A new-user trial (2 ranks, gloo) found
the terminal's header naming a SIGKILLed rank while the JSON's problems were empty; a stream cut mid-record told
"a write of the doctor's failed there (a full disk?)" in the header and "the run was cut off mid-write" in the
problems; the dashboard saying "live" for two minutes after rank 0's end record held torchrun's error; and no step
anywhere. The runs here are the recorded sample's (2 ranks, steps 0-29) ended as the trial's were."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from rich.console import Console

from conftest import SAMPLE_RUN
from fsdp_doctor.pipeline import build_report
from fsdp_doctor.present.json import render_json
from fsdp_doctor.present.terminal import render_report
from fsdp_doctor.records import End, StepRecord, record_decoder, record_encoder
from fsdp_doctor.store import load_run

# rank 0's end record in the trial's run_kill, once torchrun had SIGKILLed rank 1
RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
         "[127.0.0.1]:20142: Connection reset by peer. This is typically caused by a remote worker hanging or bugs "
         "in the application. Check the logs of the remote worker before reporting an error.")


def _ended(tmp: Path, name: str, ranks: dict, age_s: float = 600.0) -> Path:
    """The sample's records (no traces), each rank's ending as ``ranks`` gives it: rank -> (last step kept, how),
    how: "killed" (no end record), "cut" (no end record, the next step's record cut in half), "ok" (an end record),
    or an exception (an end record naming it). The streams were last written ``age_s`` seconds ago."""
    d = tmp / name
    shutil.copytree(SAMPLE_RUN, d, ignore=shutil.ignore_patterns("profiler", "tb", "report.json"))
    for r, (last, how) in ranks.items():
        s = d / f"rank{r}.records.jsonl"
        out, cut = [], b""
        for ln in s.read_bytes().splitlines():
            rec = record_decoder.decode(ln)
            if ln.startswith((b'{"t":"end"', b'{"t":"profile"')):
                continue
            if isinstance(rec, StepRecord) and rec.step > last:
                cut = cut or ln[: len(ln) // 2]
                continue
            out.append(ln + b"\n")
        if how == "cut":
            out.append(cut)
        elif how != "killed":
            end = End(rank=r, steps=last + 1, ended_ns=1_795_314_859_000_000_000 + r * 51_600_000,
                      exception="" if how == "ok" else how)
            out.append(record_encoder.encode(end) + b"\n")
        s.write_bytes(b"".join(out))
        os.utime(s, (time.time() - age_s,) * 2)
    return d


def _terminal(report) -> str:
    c = Console(width=100, record=True, color_system=None, file=open(os.devnull, "w"))
    render_report(report, c)
    return c.export_text()


def _told(d: Path) -> tuple[list[str], str, dict]:
    """The run's problems, its terminal text and its JSON."""
    report = build_report(load_run(d))
    return report.problems, _terminal(report), json.loads(render_json(report))


def _once_from_the_problems(problems: list[str], text: str, js: dict) -> None:
    """Each problem is in the JSON as it is and printed once, on a line of its own; nothing else in the terminal
    (its header) tells how a rank ended."""
    assert js["problems"] == problems
    lines = text.replace(js["run"]["path"], "").splitlines()
    for p in problems:
        assert sum(p in ln for ln in lines) == 1, (p, text)
        # nothing was skipped: the line says how the run ended ("skipped: rank 1 stopped first ..." read otherwise)
        (ln,) = [ln for ln in lines if p in ln]
        assert ln.startswith("run ended: " if "stopped" in p or "records stop" in p else "skipped: "), ln
    told = [ln for ln in lines if not any(p in ln for p in problems)]
    for words in ("did not finish", "stopped", "end record", "in the middle of a record", "mid-write", "killed"):
        assert not [ln for ln in told if words in ln], (words, text)


def test_a_killed_rank_is_told_with_its_step_in_the_json_as_in_the_terminal(tmp_path):
    """run_kill: rank 1 SIGKILLed (no end record), rank 0's end record holds the connection reset that followed.
    The JSON's problems were empty while the header said "rank 1 did not finish (run still going, or killed)":
    "still going" where rank 0's end record says the job died, and no step."""
    d = _ended(tmp_path, "kill", {0: (21, RESET), 1: (20, "killed")}, age_s=1.0)  # (fresh files: rank 0 ended)
    problems, text, js = _told(d)
    said = [p for p in problems if "rank 1" in p]
    assert said == [
        "rank 1 stopped first, after step 20, without an end record (killed, or hung); rank 0 stopped after step 21 "
        f"on {RESET[:159]}…, likely following from it; the completed steps of every rank are used"], problems
    assert "still going" not in text
    _once_from_the_problems(problems, text, js)
    # run_exit: os._exit on rank 1 in the step after rank 0's last: the rank without an end record first
    problems, text, js = _told(_ended(tmp_path, "exit", {0: (20, RESET), 1: (20, "killed")}))
    assert [p for p in problems if "rank 1" in p] == [
        "rank 1 stopped first, after step 20, without an end record (killed, or hung); rank 0 stopped after step 20 "
        f"on {RESET[:159]}…, likely following from it; the completed steps of every rank are used"], problems
    _once_from_the_problems(problems, text, js)


def test_an_exception_in_the_loop_is_told_with_its_step(tmp_path):
    """run_int (Ctrl-C) and run_raise (a ValueError on both ranks, rank 0's 51.6 ms first): the header said "ranks 0,
    1 stopped on an exception in the training loop (KeyboardInterrupt)", no step, and the JSON's problems nothing."""
    problems, text, js = _told(_ended(tmp_path, "int", {0: (14, "KeyboardInterrupt"), 1: (14, "KeyboardInterrupt")}))
    assert problems == ["ranks 0, 1 stopped after step 14 on KeyboardInterrupt; the completed steps of every rank "
                        "are used"], problems
    _once_from_the_problems(problems, text, js)
    problems, text, js = _told(_ended(tmp_path, "raise", {0: (19, "ValueError: boom at step 20 rank 0"),
                                                          1: (19, "ValueError: boom at step 20 rank 1")}))
    assert problems == ["rank 0 stopped first, after step 19, on ValueError: boom at step 20 rank 0 (51.6 ms before "
                        "rank 1); rank 1 stopped after step 19 on ValueError: boom at step 20 rank 1, likely following "
                        "from it; the completed steps of every rank are used"], problems
    _once_from_the_problems(problems, text, js)


def test_a_record_cut_mid_write_has_one_cause_in_one_line(tmp_path):
    """run_half: rank 1's last step record cut in half, rank 0 finished. The header said "a write of the doctor's
    failed there (a full disk?)", the problems "the run was cut off mid-write": one line now, one cause."""
    problems, text, js = _told(_ended(tmp_path, "half", {0: (29, "ok"), 1: (28, "cut")}))
    (said,) = problems
    assert said.startswith("rank 1's records stop after step 28 in the middle of a record ("), said
    assert said.endswith(" bytes at the end of rank1.records.jsonl): a write of the doctor's failed there (a full "
                         "disk?), the rank may have trained on; rank 0 finished after step 29; the completed steps of "
                         "every rank are used"), said
    assert "cut off mid-write" not in text + str(js)
    _once_from_the_problems(problems, text, js)


def test_still_going_only_where_no_rank_ended_and_the_records_are_fresh(tmp_path):
    """Both ranks without an end record: written a second ago, the run is still going (a note, not a problem: an
    analysis of a run in training exits 0); left for ten minutes, they stopped, each after its last step."""
    problems, text, js = _told(_ended(tmp_path, "going", {0: (20, "killed"), 1: (20, "killed")}, age_s=1.0))
    assert problems == [] and "stopped" not in text, problems
    (note,) = [n for n in js["run"]["notes"] if "still going" in n]
    assert note == "the run is still going (no rank has ended; last records: step 20 on ranks 0, 1)", note
    assert note in text
    problems, text, js = _told(_ended(tmp_path, "gone", {0: (20, "killed"), 1: (17, "killed")}))
    assert problems == ["rank 1 stopped first, after step 17, without an end record (killed, or hung); rank 0 stopped "
                        "after step 20 without an end record (killed, or hung), likely following from it; the "
                        "completed steps of every rank are used"], problems
    assert not [n for n in js["run"].get("notes", []) if "still going" in n]
    _once_from_the_problems(problems, text, js)


def test_the_dashboard_says_stopped_once_a_rank_ended_and_gives_the_same_line(tmp_path):
    """The dashboard said "live" for STALE_S after torchrun exited, rank 0's end record holding the exception, its
    top box "Steps recorded 30 · live" beside "finished r0: yes, r1: no", and no line for the cut record meanwhile.
    Once a rank ended on an exception, or every rank ended, or a rank ended normally and the others wrote nothing for
    a few seconds, the run is not live: the state says it stopped and the Problems give analyze's line."""
    from fsdp_doctor.dashboards.pages import overview
    from fsdp_doctor.dashboards.pages.common import Filters, run_state
    from fsdp_doctor.dashboards.state import RunState

    for name, ends, want, age in (("kill", {0: (21, RESET), 1: (20, "killed")}, "stopped on RuntimeError", 1.0),
                                  ("half", {0: (29, "ok"), 1: (28, "cut")}, "stopped", 30.0)):
        d = _ended(tmp_path, name, ends, age_s=age)
        snap = RunState(d, background_traces=False).snapshot()
        assert run_state(snap.report, snap.updated) == want, name  # (last written ``age`` seconds ago)
        (line,) = [p for p in load_run(d).problems if "step" in p]
        assert line in snap.problems(live=False)
        page = list(_texts(overview.layout(snap, Filters())))
        assert line in page and "live" not in page and want in page, page


def _texts(c):
    """The texts of a page's components, each whole."""
    if isinstance(c, str):
        yield c
    elif isinstance(c, (list, tuple)):
        for x in c:
            yield from _texts(x)
    elif getattr(c, "children", None) is not None:
        yield from _texts(c.children)
