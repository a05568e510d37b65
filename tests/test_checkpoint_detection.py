"""Functional activation checkpointing inside a unit (``checkpoint(self.mlp, h)`` in a block's forward) is
detected at run time and its recompute timed, like a checkpoint_wrapper on the block's children; training is
unchanged. Real FSDP2 runs on one gloo rank (tests/checkpoint_cases.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    env = {**os.environ, "CHECKPOINT_CASES_DIR": str(tmp_path_factory.mktemp("ckpt"))}
    r = subprocess.run([sys.executable, str(REPO / "tests" / "checkpoint_cases.py")], capture_output=True,
                       text=True, timeout=300, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_functional_checkpoint_of_a_submodule_reads_children_and_its_recompute_is_timed(cases):
    c = cases["children"]
    assert c["errors"] == []
    assert c["checkpoint"] == {"": "none", "layers.0": "children", "layers.1": "children", "layers.2": "children"}
    for i in range(3):  # every timed step re-ran the MLP in backward
        assert all(ms > 0 for ms in c["recompute_ms"][f"layers.{i}"])
    assert c["recompute_ms"][""] == [0.0] * 4
    assert c["global_hooks_after_first_step"] == 0  # the watch is gone after the first step


def test_checkpointing_the_whole_unit_still_reads_unit_and_nothing_reads_none(cases):
    assert set(cases["block"]["checkpoint"].values()) == {"none", "unit"}
    assert cases["block"]["checkpoint"][""] == "none"
    assert all(v == "none" for v in cases["none"]["checkpoint"].values())
    assert all(ms == 0.0 for v in cases["none"]["recompute_ms"].values() for ms in v)


@pytest.mark.parametrize("mode", ["children", "block", "none"])
def test_losses_bit_identical_with_and_without_the_doctor(cases, mode):
    assert cases[mode]["losses"] == cases[mode]["plain_losses"]


def test_the_diagnosis_sees_the_children_granularity(cases):
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report

    codes = {m: {f.code for f in build_report(load_run(cases[m]["out_dir"])).findings} for m in cases}
    assert "ac.wrong_granularity" in codes["children"]
    assert "ac.wrong_granularity" not in codes["block"] and "ac.wrong_granularity" not in codes["none"]
