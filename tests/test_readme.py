"""A first five minutes without a surprise: every ```bash and ```python block of the README runs as pasted in a
fresh shell (``PATH=/usr/bin:/bin``, no venv activated) at the repo root, except the blocks marked just above with
``<!-- readme-test: not run: REASON -->``. Each block runs in a scratch directory that sees the repo's ``.venv`` and
``traces`` (read only), so nothing it writes lands in the tree; ``PYTHONPATH`` points at this tree, as the editable
install of a fresh clone does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_pythonpath

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MARK = re.compile(r"<!--\s*readme-test:\s*not run:\s*(?P<why>.+?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>bash|python)\s*$")


def blocks() -> list[tuple[int, str, str, str | None]]:
    """(line, language, code, why-not-run or None) of every bash/python block, in order."""
    lines = README.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            prev = lines[i - 1] if i else ""
            skip = MARK.search(prev)
            out.append((i + 1, m["lang"], "\n".join(lines[i + 1:j]) + "\n", skip["why"] if skip else None))
            i = j
        i += 1
    return out


def test_every_block_is_run_or_says_why():
    found = blocks()
    assert len(found) >= 4
    for line, _, _, why in found:
        assert why is None or len(why) > 20, f"README line {line}: say why the block is not run"
    assert sum(why is None for *_, why in found) >= 2  # the analyze commands and the Python Report snippet


@pytest.mark.parametrize("line,lang,code", [(ln, lang, code) for ln, lang, code, why in blocks() if why is None],
                         ids=lambda x: str(x) if isinstance(x, int) else "")
def test_block_runs_in_a_fresh_shell(line, lang, code, tmp_path):
    venv = (REPO / ".venv").exists()
    if not venv and ".venv/" in code:  # e.g. the GPU machine: a copy of the tree, its dependencies on PYTHONPATH
        pytest.skip("this checkout has no .venv (no `make setup`): the block runs .venv/bin's commands")
    for name in (".venv", "traces") if venv else ("traces",):
        (tmp_path / name).symlink_to(REPO / name)
    # without a .venv the block runs on this interpreter, whose dependencies may be on PYTHONPATH: kept
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO) if venv else child_pythonpath(REPO),
           "OMP_NUM_THREADS": "1", "COLUMNS": "100", "LANG": os.environ.get("LANG", "C.UTF-8")}
    if lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        cmd = [str(REPO / ".venv" / "bin" / "python") if venv else sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "Traceback" not in r.stderr, (
        f"README line {line} ({lang}) failed with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    if lang == "bash" and "--json report.json" in code:
        assert (tmp_path / "report.json").exists() and (tmp_path / "report.html").exists()
    if lang == "python" and "Report.of" in code:
        assert "compute-bound" in r.stdout
