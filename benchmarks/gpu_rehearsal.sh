#!/usr/bin/env bash
# A rehearsal, on a CPU, of the GPU session's device call (`make gpu-rehearsal`; not part of `make test`):
#   1. a Python 3.12 environment of the GPU machine's own packages (MACHINE in benchmarks/gpu_wheels.sh: torch
#      2.11.0, its CUDA build, which runs on the CPU; transformers 5.17, ...) and nothing else, made once under
#      REHEARSAL_DIR (~7 GB, a few minutes) and reused while its stamp matches MACHINE;
#   2. `make gpu-wheels`, and a copy of what the device tool carries (the files git tracks or does not ignore,
#      and .whl/) in a temporary folder, without this checkout's .venv and without shared/;
#   3. the README's device command itself (read from the README), `python3` being that environment's, with
#      `--dry-run` after its `--budget-s N` and $OUT a temporary folder; then whether the carried wheels have every
#      requirement (benchmarks/wheel_closure.py); with --tests, the tests marked compat in that environment, in the
#      copied tree; with --suite, the whole CPU suite there (-m "not browser" -x: 15-25 minutes on 2 shared cores).
# It prints a few lines (the steps' statuses, the wall time, the tarballs) and exits 1 when anything failed.
#   benchmarks/gpu_rehearsal.sh [--tests|--suite] [--keep]      (--keep: leave the temporary folder for a look)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
REHEARSAL_DIR=${REHEARSAL_DIR:-$HOME/.cache/fsdp_doctor/rehearsal}
# the first Python 3.12 that runs (pyenv's shim for python3.12 is on PATH but fails unless 3.12 is selected)
if [ -z "${PY312:-}" ]; then
  for c in python3.12 /root/.pyenv/versions/3.12.*/bin/python; do
    if "$c" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null; then PY312=$c; break; fi
  done
fi
PY312=${PY312:-python3.12}
tests=""; keep=0
for a in "$@"; do
  case $a in --tests) tests=compat ;; --suite) tests="not browser" ;; --keep) keep=1 ;;
    *) echo "usage: $0 [--tests|--suite] [--keep]"; exit 2 ;; esac
done

eval "$(grep -E '^MACHINE=' benchmarks/gpu_wheels.sh)"
py="$REHEARSAL_DIR/bin/python"
stamp="$REHEARSAL_DIR/.fsdp-doctor-rehearsal-stamp"
want="python 3.12; $MACHINE"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$py" ]; }; then
  mkdir -p "$(dirname "$REHEARSAL_DIR")"
  exec 9>"$REHEARSAL_DIR.lock"; flock 9
  if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$py" ]; }; then
    # an environment of another Python is made anew; one of 3.12 is completed (pip installs what differs)
    "$py" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null || rm -rf "$REHEARSAL_DIR"
    echo "gpu-rehearsal: $([ -x "$py" ] && echo completing || echo making) $REHEARSAL_DIR: Python 3.12, $MACHINE" \
         "(~7 GB, a few minutes when new; pip is quiet) ..."
    [ -x "$py" ] || "$PY312" -m venv "$REHEARSAL_DIR"
    "$py" -c "import sys; assert sys.version_info[:2] == (3, 12), sys.version" \
      || { echo "gpu-rehearsal: $PY312 is not Python 3.12 (set PY312)"; exit 1; }
    # shellcheck disable=SC2086
    PIP_CONSTRAINT=/dev/null "$py" -m pip install -q --disable-pip-version-check --progress-bar off $MACHINE 2>&1 \
      | grep -v "^WARNING: Location" || true
    torch_want=$(echo "$MACHINE" | grep -oE 'torch==[0-9.]+' | cut -d= -f3)
    "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_want')" \
      || { echo "gpu-rehearsal: torch $torch_want did not install into $REHEARSAL_DIR"; exit 1; }
    echo "$want" > "$stamp"
  fi
  exec 9>&-
fi

bash benchmarks/gpu_wheels.sh | tail -n 1
tmp=$(mktemp -d /tmp/fsdp_doctor_rehearsal.XXXXXX)
[ $keep = 1 ] || trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/tree" "$tmp/out"
git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$tmp/tree"
cp -r .whl "$tmp/tree/.whl"

# the README's device command, as the GPU session sends it; only --dry-run and the folders differ
cmd=$(grep -E '^ *python3 -m pip install .*--budget-s [0-9]+' README.md | head -n 1 | sed 's/^ *//')
[ -n "$cmd" ] || { echo "gpu-rehearsal: no device command (python3 -m pip install ... --budget-s N) in README.md"; exit 1; }
dry=$(printf '%s' "$cmd" | sed -E -e "s#--budget-s ([0-9]+)#--budget-s \\1 --dry-run#" -e "s#/tmp/site#$tmp/site#g" \
      -e "s|/tmp/c |$tmp/c |g")
for part in "--dry-run" "$tmp/site" "$tmp/c " '--pack $OUT'; do
  case $dry in *"$part"*) ;; *) echo "gpu-rehearsal: cannot adapt the command ($part): $cmd"; exit 1 ;; esac
done
echo "gpu-rehearsal: $("$py" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")'), in $tmp"
t0=$(date +%s)
status=0
(cd "$tmp/tree" && env -u PYTHONPATH -u FSDP_DOCTOR_SHARED PATH="$REHEARSAL_DIR/bin:$PATH" OUT="$tmp/out" \
   bash -c "$dry" > "$tmp/device.log" 2>&1) || status=$?
wall=$(( $(date +%s) - t0 ))

"$py" - "$tmp" "$wall" "$status" <<'EOF' || status=1
import json, sys
from pathlib import Path
tmp, wall, rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
try:
    steps = json.loads((tmp / "c" / "summary.json").read_text())["steps"]
except (OSError, ValueError, KeyError):
    steps = []
bad = [s for s in steps if s["status"] != "ok"]
print(f"gpu-rehearsal: device command (dry run) in {wall} s, exit {rc}: {len(steps) - len(bad)}/{len(steps)} steps ok"
      + "".join(f"; {s['name']}: {s['status']}" for s in bad))
print("gpu-rehearsal: " + ", ".join(f"{s['name']} {s['seconds']:.0f} s" for s in steps))
packed = sorted(p.name + f" {p.stat().st_size / 2**20:.1f} MiB" for p in (tmp / "out").iterdir())
print(f"gpu-rehearsal: $OUT holds {', '.join(packed) or 'nothing'}")
sys.exit(1 if rc or bad or not steps or not packed else 0)
EOF
(cd "$tmp/tree" && PYTHONPATH="$tmp/site" "$py" benchmarks/wheel_closure.py --site "$tmp/site") | sed 's/^/gpu-rehearsal: /' \
  || status=1
if [ -n "$tests" ]; then  # as on the machine: the copied tree, no .venv, no shared/, the wheels on PYTHONPATH
  (cd "$tmp/tree" && env -u FSDP_DOCTOR_SHARED PYTHONPATH="$tmp/site:$tmp/tree" OMP_NUM_THREADS=1 \
     "$py" -m pytest -q -x -p no:cacheprovider -m "$tests" > "$tmp/tests.log" 2>&1) || status=1
  grep -E "^(FAILED|ERROR) " "$tmp/tests.log" | head -n 5 | sed 's/^/gpu-rehearsal: /' || true
  echo "gpu-rehearsal: tests (-m \"$tests\"): $(tail -n 1 "$tmp/tests.log")"
fi
[ $status = 0 ] || echo "gpu-rehearsal: FAILED (the device command's output: $tmp/device.log, the tests': tests.log$([ $keep = 1 ] || echo ', removed: rerun with --keep'))"
exit $status
