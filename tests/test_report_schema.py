"""The --json report's stable form: every section key present (null or [] when empty) and its JSON schema
published with the package, equal to the one generated from the typed report."""

import json
from pathlib import Path

import msgspec

from fsdp_doctor import cli
from fsdp_doctor.report_sections import Report
from trace_fixtures import gpu_known_trace

SAMPLE = Path(__file__).resolve().parent.parent / "traces" / "sample"


def test_published_schema_is_current():
    published = cli.SCHEMA_FILE.read_text()
    assert published == cli.schema_text(), (
        "fsdp_doctor/report.schema.json is stale: regenerate it with `fsdp-doctor schema > "
        "fsdp_doctor/report.schema.json`")
    schema = json.loads(published)
    top = schema["$defs"]["Report"]["properties"]
    assert {"findings", "steps", "units", "memory", "overlap", "problems", "verdict"} <= set(top)


def test_schema_command_prints_it(capsys):
    assert cli.main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == Report.json_schema()


def _keys():
    return set(Report.__struct_fields__)


def test_every_key_present_on_a_trace_only_report(tmp_path):
    f = gpu_known_trace(rank=0).write(tmp_path / "rank0.json")
    out = tmp_path / "r.json"
    assert cli.main(["analyze", str(f), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r) == _keys()
    assert r["findings"] == [] or isinstance(r["findings"], list)
    assert r["steps"] is None and r["units"] is None and r["memory"] is None  # no records: null, not absent
    assert msgspec.convert(r, Report).overlap is not None


def test_every_key_present_on_a_recorded_run(tmp_path):
    out = tmp_path / "r.json"
    cli.main(["analyze", str(SAMPLE), "--json", str(out)])
    r = json.loads(out.read_text())
    assert set(r) == _keys()
    assert isinstance(r["findings"], list) and isinstance(r["problems"], list)
    assert r["steps"] is not None and r["units"]
    assert msgspec.json.decode(out.read_bytes(), type=Report) == Report.of(r)  # the form reads back, typed


def test_the_schema_requires_every_key_and_names_the_severities():
    """A CI check validated ``{}`` and ``{"severity": "bogus"}`` findings against the published schema (a new-user
    trial): every report key is required (all are always written, the tests above check it), and a finding's
    severity and a rule's status are the doctor's own words, listed."""
    from fsdp_doctor.diagnose.base import SEVERITIES

    schema = json.loads(cli.SCHEMA_FILE.read_text())
    top = schema["$defs"]["Report"]
    assert set(top["required"]) == _keys() == set(top["properties"])
    assert sorted(schema["$defs"]["Finding"]["properties"]["severity"]["enum"]) == sorted(SEVERITIES)
    assert sorted(schema["$defs"]["RuleStatus"]["properties"]["status"]["enum"]) == [
        "failed", "fired", "quiet", "skipped"]
    # a report that says another severity does not read back typed
    r = json.loads((SAMPLE / "report.json").read_text())
    r["findings"][0]["severity"] = "bogus"
    try:
        msgspec.convert(r, Report)
    except msgspec.ValidationError as e:
        assert "severity" in str(e)
    else:
        raise AssertionError("a bogus severity read back")
