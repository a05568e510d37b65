"""A torchtitan ``--module`` of the tests' own, as a user of torchtitan 0.3.0 writes one (a module with config
functions, named on the command line by its import path): ``--module titan_registry --config tiny`` runs
torchtitan's own Trainer (``torchtitan.train``, or ``fsdp_doctor.titan`` with the doctor) on this machine.

``tiny()`` is llama3_debugmodel's job as torchtitan's registry writes it (its chunked loss, selective
checkpointing, AdamW with warm-up and decay, its c4_test text loader, validation and checkpoint settings) on a
tiny llama3 (tests/titan_cases.llama: SDPA attention) and small assets this file writes (``write_assets``: a
character tokenizer, a text dataset in c4_test's layout), since torchtitan's own test assets come with its
source tree, not its wheel.

What this CPU needs, set when torchtitan imports this module (before its Trainer is built): torchtitan's device
type "cpu" (it reads CUDA's by default, in several modules) and plain SUM reduction of gradients on gloo
(torchtitan divides by the token count itself and sets FSDP's divide factor to 1, which FSDP reduces with
PREMUL_SUM, which gloo lacks). torchtitan 0.3.0 shortens the process groups' timeouts after the first step with
``torch.distributed.set_timeout``, which torch 2.13 lacks: that change is skipped there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: where ``write_assets`` put the tokenizer and the dataset (the test sets it for the rank processes)
ASSETS_ENV = "FSDP_DOCTOR_TITAN_ASSETS"
WIDTH, LAYERS, SEQ = 64, 4, 64
CHARS = "abcdefghijklmnopqrstuvwxyz .,"


def write_assets(folder: Path, docs: int = 400) -> Path:
    """A character-level tokenizer (tokenizer.json and its config, with begin and end of text) and a text dataset
    in c4_test's layout (``data.json``, one {"text": ...} per line), deterministic; needs ``tokenizers`` only."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|end_of_text|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    (folder / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
         "add_eos_token": True}))
    rng = random.Random(0)
    words = ["".join(rng.choice(CHARS[:26]) for _ in range(rng.randint(2, 8))) for _ in range(300)]
    (folder / "c4").mkdir(exist_ok=True)
    with open(folder / "c4" / "data.json", "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "."}) + "\n")
    return folder


class _CpuModule:
    """torch.cpu with what torchtitan's metrics ask of a device module (its name, its memory: none recorded)."""

    def __getattr__(self, name):
        import torch

        return getattr(torch.cpu, name)

    def current_device(self):  # (a barrier's device id)
        return 0

    def get_device_name(self, device=None):
        return "cpu"

    def get_device_properties(self, device=None):
        from types import SimpleNamespace

        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device=None):
        return {}

    def reset_peak_memory_stats(self, device=None):
        pass

    def empty_cache(self):
        pass


def cpu_shims() -> None:
    """torchtitan on this machine: its device type "cpu" wherever a module holds it, SUM reduction, no timeout
    change torch 2.13 cannot make. Once per process (tests/titan_cases.py calls it too)."""
    import importlib

    import torchtitan.distributed.fsdp as TF

    if getattr(TF.disable_fsdp_gradient_division, "_cpu_shim", False):
        return

    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.parallel_dims",
                 "torchtitan.distributed.utils", "torchtitan.models.common.token_dispatcher",
                 "torchtitan.tools.profiler"):
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = _CpuModule()
    from torch.distributed.fsdp import FSDPModule

    divide = TF.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model):
        divide(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    disable_fsdp_gradient_division._cpu_shim = True
    TF.disable_fsdp_gradient_division = disable_fsdp_gradient_division
    import torch.distributed as dist
    import torchtitan.distributed.utils as DU

    if not hasattr(dist, "set_timeout"):  # (torch 2.13 has none: the Trainer's timeout change after step 1)
        DU.set_pg_timeouts = lambda timeout, parallel_dims: None


if "torchtitan" in sys.modules:  # (imported by torchtitan's ConfigManager; the test process imports write_assets)
    cpu_shims()


def tiny():
    """llama3_debugmodel's job on the tiny llama3 and this file's assets: 16 steps of 2 sequences of 64 tokens,
    fp32 parameters, the classic FSDP2 path (partial_dtensor); validation (``--validator.enable``) every 5
    steps, 2 batches."""
    from titan_cases import llama
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    assets = Path(os.environ[ASSETS_ENV])
    config = llama3_debugmodel()
    config.model_spec.model = llama(WIDTH, LAYERS, seq=SEQ)
    config.loss.loss_fn = CrossEntropyLoss.Config(global_vocab_size=config.model_spec.model.vocab_size)
    config.hf_assets_path = str(assets / "tokenizer")
    config.dataloader.dataset_path = str(assets / "c4")
    config.training.local_batch_size = 2
    config.training.seq_len = SEQ
    config.training.steps = 16
    config.training.mixed_precision_param = "float32"
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(assets / "c4"),
                                                                   infinite=False)
    config.validator.steps = 2
    return config


#: a file holding a fix the doctor printed for torchtitan's config_registry function (tests/test_titan_trainer.py)
FIX_ENV = "FSDP_DOCTOR_TITAN_FIX"


def tiny_fixed():
    """``tiny()`` with the fix in the file ``$FSDP_DOCTOR_TITAN_FIX`` pasted as the doctor printed it into this
    config function (its ``config``: the Trainer.Config returned)."""
    config = tiny()
    exec(Path(os.environ[FIX_ENV]).read_text(), {"config": config})
    return config


#: a pause per document of the slow loader's text processing (s): a data pipeline that makes the step wait
SLOW_DOC_S = 0.08


def tiny_slow_data():
    """``tiny()`` reading its text through a slow processing step (SLOW_DOC_S per document, in the dataset's
    own sample processor: what torchtitan's loader runs per document, in the training process unless its
    DataLoader has workers): the loop waits for data."""
    import time

    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def slow(sample):
        time.sleep(SLOW_DOC_S)
        return sample["text"]

    DATASETS["c4_slow"] = DatasetConfig(path="", loader=DATASETS["c4_test"].loader, sample_processor=slow)
    config = tiny()
    config.dataloader.dataset = "c4_slow"
    return config
