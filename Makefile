# Two commands for a fresh machine: `make demo` and `make test` (each runs `setup` first).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.setup-stamp
# This machine has no GPU: pin the CPU wheel from the local index so pip does not pull a multi-GB CUDA build.
# The package itself accepts any torch >= 2.6 (see pyproject.toml).
TORCH_PIN ?= torch==2.13.0

# `make test-compat`: the tests marked `compat` on each end of the supported torch range, each in its own
# virtual environment under COMPAT_DIR (made once, ~1-3 min and ~7 GB each; reused while its stamp matches).
COMPAT_DIR   ?= $(HOME)/.cache/fsdp_doctor/compat
COMPAT_TORCH ?= 2.6.0 2.15.0

.PHONY: setup demo test test-fast test-compat browser-deps clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@echo "setup: installing $(TORCH_PIN) and fsdp-doctor[test] into $(VENV) ..."
	@$(VPY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(VPY) -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(VPY) -c "import torch, fsdp_doctor, dash, msgspec, rich" || (echo "setup: install failed"; exit 1)
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/fsdp-doctor demo

browser-deps:
	@bash .ci/browser-deps.sh

test: setup browser-deps
	$(VPY) -m pytest -q

test-compat:
	@t0=$$(date +%s); for v in $(COMPAT_TORCH); do \
	  py=$$(bash .ci/compat-env.sh "$(COMPAT_DIR)" $$v | tail -n 1) || exit 1; \
	  echo "test-compat: torch $$v ($$py), tests marked compat, this checkout ($(CURDIR))"; \
	  OMP_NUM_THREADS=1 PYTHONPATH="$(CURDIR)" $$py -m pytest -q -p no:cacheprovider -m compat || exit 1; \
	done; echo "test-compat: torch $(COMPAT_TORCH) passed in $$(( $$(date +%s) - t0 )) s"

test-fast: setup
	$(VPY) -m pytest -q -m "not browser and not slow"

clean:
	rm -rf $(VENV) .pytest_cache
