#!/usr/bin/env bash
# The Python packages the GPU machine lacks (see ../shared/notes/gpu-machine.md), as cp312 x86-64 wheels in .whl/
# (git-ignored), for the device tool to carry: `make gpu-wheels` here, then name `.whl` in the run's `carry`.
# Versions are this checkout's virtual environment's, so both machines run the same code; ~25 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PKGS="msgspec dash dash-ag-grid plotly torch-tb-profiler flask blinker itsdangerous retrying nest-asyncio
      pydantic pydantic-core annotated-types typing-inspection typing-extensions comm janus importlib-metadata
      expecttest"
mkdir -p .whl
for p in $PKGS; do
  v=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p" 2>/dev/null || true)
  spec=$p${v:+==$v}
  ls .whl | grep -qi "^$(echo "$p" | tr - _)-${v:-}" && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec" \
    || { echo "gpu-wheels: could not download $spec"; exit 1; }
done
echo "gpu-wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
