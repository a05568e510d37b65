#!/usr/bin/env bash
# The Python packages the GPU machine lacks (see ../shared/notes/gpu-machine.md), as cp312 x86-64 wheels in .whl/
# (git-ignored), for the device tool to carry: `make gpu-wheels` here, then name `.whl` in the run's `carry`.
# Versions are this checkout's virtual environment's, so both machines run the same code; ~29 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# What the GPU machine has (its python3's packages, with their own dependencies): never carried. The rehearsal
# (benchmarks/gpu_rehearsal.sh) builds a Python 3.12 environment of exactly these; tests/test_gpu_wheels.py
# checks that PKGS holds every dependency of fsdp-doctor (and of expecttest) outside their closure.
MACHINE="torch==2.11.0 transformers==5.17.0 tensorboard rich numpy pandas nvidia-ml-py pytest"
# What it lacks: fsdp-doctor's dependencies and theirs (with --no-deps nothing else is installed: a missing one
# fails only when imported, e.g. dash without narwhals); expecttest for torch's test Transformer (tests/clients.py)
PKGS="msgspec dash dash-ag-grid plotly narwhals torch-tb-profiler flask blinker itsdangerous retrying nest-asyncio
      pydantic pydantic-core annotated-types typing-inspection typing-extensions comm janus importlib-metadata zipp
      lazy-importer requests urllib3 charset-normalizer certifi psutil expecttest"
mkdir -p .whl
for p in $PKGS; do
  v=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p" 2>/dev/null || true)
  spec=$p${v:+==$v}
  n=$(echo "$p" | tr 'A-Z-' 'a-z_')
  # another version left by an earlier run goes: `pip install .whl/*.whl` refuses two versions of one package
  for f in .whl/*.whl; do
    b=$(basename "$f" | tr 'A-Z' 'a-z')
    case $b in "$n-${v:-}-"*) ;; "$n"-[0-9]*) [ -n "$v" ] && rm -f "$f" ;; esac
  done
  ls .whl | grep -qi "^$n-${v:-}" && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec" \
    || { echo "gpu-wheels: could not download $spec"; exit 1; }
done
dups=$(ls .whl | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d | tr '\n' ' ')
[ -z "$dups" ] || { echo "gpu-wheels: several versions of $dups in .whl/ (remove the old ones)"; exit 1; }
echo "gpu-wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
