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

.PHONY: setup titan-site trl-site olmo-site demo test test-long test-fast test-compat test-gpu gpu-wheels gpu-campaign gpu-rehearsal browser-deps clean plotlyjs-basic

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@echo "setup: 1/4 installing $(TORCH_PIN) into $(VENV) (about a minute on a fresh machine; pip is quiet meanwhile) ..."
	@$(VPY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)" 2>&1 | grep -v "^WARNING: Location" || true
	@echo "setup: 2/4 installing fsdp-doctor[test] and its dependencies (dash, plotly, tensorboard, ...) ..."
	@$(VPY) -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(VPY) -c "import torch, fsdp_doctor, dash, msgspec, rich" || (echo "setup: install failed"; exit 1)
	@echo "setup: 3/4 torchtitan $(TITAN_VERSION), TRL $(TRL_VERSION) and OLMo-core $(OLMO_VERSION) for the tests, each in its own folder (under $(VENV): on the tests' path only) ..."
	@$(MAKE) -s titan-site trl-site olmo-site
	@echo "setup: 4/4 plotly.js basic bundle for smaller HTML reports (optional) ..."
	@$(MAKE) -s plotlyjs-basic
	@touch $(STAMP)
	@echo "setup: done. Commands are in $(VENV)/bin: run them as $(VENV)/bin/fsdp-doctor, or 'source $(VENV)/bin/activate' first"

# torchtitan, a real client of the tests (tests/titan_cases.py: its llama3, parallelize_llama and command line),
# installed without its dependencies into a folder of its own that only those tests put on their path: its
# pins (huggingface_hub < 2 through datasets) would otherwise move what transformers needs. What it imports to
# build, shard and parse a llama3 config: triton (importable, no GPU needed), datasets (its config registry's
# data loaders), tyro (its command line) and their own imports.
TITAN_VERSION := 0.3.0
TITAN_SITE    := $(VENV)/torchtitan
TITAN_PKGS    := torchtitan==$(TITAN_VERSION) triton==3.9.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 \
                 torchdata==0.11.0 einops==0.8.2 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
                 datasets==4.7.0 pyarrow==26.0.1 dill==0.4.0 multiprocess==0.70.18 xxhash==4.1.0 httpx==0.28.1 \
                 httpcore==1.0.9
titan-site:
	@rm -rf $(TITAN_SITE) && $(VPY) -m pip install -q --disable-pip-version-check --no-deps \
	  --target $(TITAN_SITE) $(TITAN_PKGS) 2>&1 | grep -v "^WARNING: Location" || true
	@PYTHONPATH=$(TITAN_SITE) $(VPY) -c "import torchtitan.models.llama3.parallelize, torchtitan.config" \
	  || (echo "setup: torchtitan $(TITAN_VERSION) does not import from $(TITAN_SITE)"; exit 1)

# TRL, a real client of the tests (tests/trl_cases.py: its SFTTrainer), alike without its dependencies in a folder of
# its own: what it imports beyond transformers and accelerate (datasets) is torchtitan's folder's, as pinned there
TRL_VERSION := 1.16.0
TRL_SITE    := $(VENV)/trl
trl-site:
	@rm -rf $(TRL_SITE) && $(VPY) -m pip install -q --disable-pip-version-check --no-deps \
	  --target $(TRL_SITE) trl==$(TRL_VERSION) 2>&1 | grep -v "^WARNING: Location" || true
	@PYTHONPATH=$(TRL_SITE):$(TITAN_SITE) $(VPY) -c "import trl; from trl import SFTTrainer" \
	  || (echo "setup: TRL $(TRL_VERSION) does not import from $(TRL_SITE)"; exit 1)

# OLMo-core, a real client of the tests (tests/olmo_cases.py: its Trainer), alike without dependencies resolved in a
# folder of its own: what it imports beyond this venv (its cached_path's S3 and Google Cloud clients), pinned
OLMO_VERSION := 3.0.0
OLMO_SITE    := $(VENV)/olmo
OLMO_PKGS    := ai2-olmo-core==$(OLMO_VERSION) cached-path==1.8.10 dataclass-extensions==0.5.0 bettermap==1.3.1 \
                importlib_resources==7.1.0 boto3==1.44.18 botocore==1.44.18 s3transfer==0.19.3 jmespath==1.1.0 \
                google-cloud-storage==3.17.2 google-api-core==2.44.0 google-auth==2.63.1 google-cloud-core==2.8.0 \
                google-resumable-media==2.11.0 google-crc32c==1.9.0 googleapis-common-protos==1.76.0 \
                proto-plus==1.29.0 protobuf==7.36.2 pyasn1==0.6.5 pyasn1-modules==0.4.2
olmo-site:
	@rm -rf $(OLMO_SITE) && $(VPY) -m pip install -q --disable-pip-version-check --no-deps \
	  --target $(OLMO_SITE) $(OLMO_PKGS) 2>&1 | grep -v "^WARNING: Location" || true
	@PYTHONPATH=$(OLMO_SITE) $(VPY) -W ignore -c "from olmo_core.train import TrainerConfig" 2>/dev/null \
	  || (echo "setup: OLMo-core $(OLMO_VERSION) does not import from $(OLMO_SITE)"; exit 1)

# The HTML report draws only bars and scatter traces: plotly.js's basic bundle (npm plotly.js-basic-dist-min,
# the version plotly.py bundles) keeps it at ~1.3 MB instead of ~4.9 MB. Optional: without npm the full bundle is used.
PLOTLYJS_DIR := $(VENV)/share/fsdp-doctor
plotlyjs-basic:
	@v=$$($(VPY) -c "import plotly.offline as o; print(o.get_plotlyjs_version())"); tmp=$$(mktemp -d); \
	if command -v npm >/dev/null 2>&1 && (cd $$tmp && npm pack -q "plotly.js-basic-dist-min@$$v" >/dev/null 2>&1) \
	   && tar xzf $$tmp/plotly.js-basic-dist-min-$$v.tgz -C $$tmp 2>/dev/null; then \
	  mkdir -p $(PLOTLYJS_DIR) && cp $$tmp/package/plotly-basic.min.js $(PLOTLYJS_DIR)/ && \
	  echo "setup: plotly.js basic bundle v$$v installed in $(PLOTLYJS_DIR)"; \
	else echo "setup: plotly.js basic bundle v$$v not available (no npm or no registry): HTML reports inline the full bundle"; fi; \
	rm -rf $$tmp

demo: setup
	$(VENV)/bin/fsdp-doctor demo --overwrite

browser-deps:
	@bash .ci/browser-deps.sh

# The suite starts many Python processes (rank scripts, command lines, torchrun): with PYTHONDONTWRITEBYTECODE set
# (as on this machine) each would compile this tree's modules again (up to 0.7 s a process); compiled once first.
COMPILE_TREE := $(VPY) -m compileall -q -j 0 fsdp_doctor dashboards tests benchmarks > /dev/null
# The versions the suite runs against, first in its log: the test extra's clients are unpinned, the newest the
# registry has (accelerate 1.16 sharded a checkpointed layer's wrapper where 1.15 sharded the layer inside it: CI
# installed it overnight and three Trainer tests failed, with nothing in the log to say which accelerate it was)
VERSIONS := $(VPY) -c "import importlib.metadata as m; print('versions:', ', '.join(f'{n} {m.version(n)}' for n in \
  ('torch', 'transformers', 'accelerate', 'diffusers', 'dash', 'plotly')))"

# `make test`: the suite but its long tier (tests marked `long`, tests/conftest.py: the scenario matrix, the other
# fixes pasted and rerun, torchtitan, the HF Trainer, accelerate's plugin, the browser), within the 15 minutes it is
# given on this 2-core kind of host; `make test-long`: that tier. CI (.ci/run) runs both, then `make test-compat`.
# (benchmarks/suite_cost.py: what each test costs.)
test: setup
	@$(COMPILE_TREE)
	@$(VERSIONS)
	$(VPY) -m pytest -q -m "not long"

test-long: setup browser-deps
	@$(COMPILE_TREE)
	@$(VERSIONS)
	$(VPY) -m pytest -q -m long

test-compat:
	@t0=$$(date +%s); for v in $(COMPAT_TORCH); do \
	  py=$$(bash .ci/compat-env.sh "$(COMPAT_DIR)" $$v | tail -n 1) || exit 1; \
	  echo "test-compat: torch $$v ($$py), tests marked compat, this checkout ($(CURDIR))"; \
	  OMP_NUM_THREADS=1 PYTHONPATH="$(CURDIR)" $$py -m pytest -q -p no:cacheprovider -m compat || exit 1; \
	done; echo "test-compat: torch $(COMPAT_TORCH) passed in $$(( $$(date +%s) - t0 )) s"

# The GPU tier (tests marked `gpu`, skipped without CUDA) and the whole GPU campaign (benchmarks/gpu_campaign.py).
# On the GPU machine there is no .venv and no registry: `make gpu-wheels` here, carry .whl, and run there
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# then `make test-gpu` or `make gpu-campaign` (GPU_PY defaults to python3 where this checkout has no .venv).
GPU_PY ?= $(if $(wildcard $(VPY)),$(VPY),python3)
CAMPAIGN_OUT ?= /tmp/fsdp_doctor_gpu_campaign
test-gpu:
	$(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu -rs

gpu-wheels:
	@bash benchmarks/gpu_wheels.sh

gpu-campaign:
	$(GPU_PY) benchmarks/gpu_campaign.py --out $(CAMPAIGN_OUT)

# The GPU session's device call rehearsed here (not part of `make test`): a Python 3.12 environment of the GPU
# machine's packages (torch 2.11.0 ...; made once, ~7 GB, under REHEARSAL_DIR), the carried wheels installed as
# there, the README's device command run with --dry-run. REHEARSAL_ARGS=--tests adds the tests marked compat,
# REHEARSAL_ARGS=--suite the whole CPU suite (in the copied tree, as on that machine).
REHEARSAL_DIR ?= $(HOME)/.cache/fsdp_doctor/rehearsal
REHEARSAL_ARGS ?=
gpu-rehearsal:
	@REHEARSAL_DIR="$(REHEARSAL_DIR)" bash benchmarks/gpu_rehearsal.sh $(REHEARSAL_ARGS)

test-fast: setup
	@$(COMPILE_TREE)
	$(VPY) -m pytest -q -m "not browser and not slow"

clean:
	rm -rf $(VENV) .pytest_cache
