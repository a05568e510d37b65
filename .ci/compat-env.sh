#!/usr/bin/env bash
# Makes (or reuses) the virtual environment of one torch version for `make test-compat`:
#   .ci/compat-env.sh COMPAT_DIR VERSION     -> prints the env's python on the last line
# The env holds torch==VERSION (the registry's build, CUDA libraries included; it runs on CPU here) and
# the package's runtime dependencies plus pytest, never the package itself: the tests import this
# checkout through PYTHONPATH, so several clones can share one env. A stamp records what was installed
# (torch version and the dependency list); a changed dependency list reinstalls the dependencies only.
# Installs are serialised with flock, so two CI runs on one machine do not install into one env at once.
set -euo pipefail
dir="$1"; ver="$2"
root="$(cd "$(dirname "$0")/.." && pwd)"
env="$dir/torch-$ver"
py="$env/bin/python"
mkdir -p "$dir"
deps="$(python3 - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = [d for d in p["dependencies"] if not d.replace(" ", "").startswith("torch>") and not d.startswith("torch ")]
print(" ".join(sorted(deps) + ["pytest>=7"]))
EOF
)"
want="torch==$ver deps: $deps"
stamp="$env/.fsdp-doctor-compat-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$py" ]; then echo "$py"; exit 0; fi
exec 9>"$dir/.lock-$ver"
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$py" ]; then echo "$py"; exit 0; fi
quiet() { grep -v "^WARNING: Location" || true; }
t0=$(date +%s)
if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$ver')" 2>/dev/null; then
  echo "test-compat: creating $env with torch==$ver (the registry's build: ~1-3 min, ~7 GB) ..." >&2
  [ -x "$py" ] || python3 -m venv "$env"
  # this machine caps torch in a pip constraint file; the compat matrix goes past it on purpose
  PIP_CONSTRAINT=/dev/null "$py" -m pip install --disable-pip-version-check --progress-bar off \
    "torch==$ver" 2>&1 | quiet | grep -E "^(Collecting torch|Installing|Successfully|ERROR)" >&2 || true
fi
echo "test-compat: installing the runtime dependencies into $env (torch pinned at $ver) ..." >&2
pin="$env/.torch-pin.txt"
"$py" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" 2>/dev/null > "$pin"
# the pin keeps pip from touching torch (a dependency asking for another torch fails instead); without the local
# part (+cu130), which the installed build still matches: pinned with it, pip could not resolve a package needing
# torch>=2.0 (accelerate 1.15: ResolutionImpossible; unpinned by version, pip took accelerate 0.0.1: a trial)
PIP_CONSTRAINT="$pin" "$py" -m pip install --disable-pip-version-check --progress-bar off $deps 2>&1 \
  | quiet | grep -E "^(Installing|Successfully|ERROR)" >&2 || true
"$py" -c "import torch, msgspec, rich, numpy, pytest; assert torch.__version__.split('+')[0] == '$ver'" \
  || { echo "test-compat: the environment $env is incomplete (see above)" >&2; exit 1; }
echo "$want" > "$stamp"
echo "test-compat: $env ready in $(( $(date +%s) - t0 )) s" >&2
echo "$py"
