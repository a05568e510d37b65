"""TRL, a real client of the tests: its SFTTrainer (a Hugging Face Trainer subclass, the fine-tuning path most
FSDP2 users of Hugging Face models take) recorded with fsdp_doctor.DoctorCallback, on gloo ranks.

TRL is installed without its dependencies into a folder of its own (Makefile: TRL_SITE) that only these ranks put on
their path; the ``datasets`` it imports is torchtitan's folder's (TITAN_SITE), as pinned there. The Trainer shards
the model through accelerate's FSDP2 plugin, forced to FSDP as on a GPU (recorder_cases.make_trainer).

A case: ``python tests/trl_cases.py sft RANK WORLD PORT OUT`` (tests/test_trl.py launches it); its RESULT is the
run's findings and quiet reasons (recorder_cases._outcome), the collectives no FSDP unit issued by phase, and the
losses, for the run as is and for it with prefetch.sync_unshard's fix pasted as printed (``trainer.add_callback``
before ``trainer.train()``)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: where `make setup` installs TRL (Makefile: TRL_SITE), and torchtitan's folder, which holds the datasets it imports
TRL_SITE = Path(os.environ.get("FSDP_DOCTOR_TRL_SITE", ROOT / ".venv" / "trl"))

import torch.distributed as dist

import fsdp_doctor
from recorder_cases import _outcome, force_fsdp
from titan_cases import TITAN_SITE

#: the case's optimizer steps (the doctor's profiler window: steps 6-7) and micro-batches a step
STEPS, MICRO = 10, 2


def sft_trainer(out: Path, callbacks: list):
    """TRL's SFTTrainer of a 4-layer Llama (width 256) on 256 texts of 20-60 words of a 253-token word-level
    tokenizer, 4 sequences of at most 64 tokens a micro-batch, MICRO micro-batches a step, sharded by the FSDP2 plugin
    the Trainer makes from ``fsdp_config`` (each decoder layer a unit)."""
    from accelerate import FullyShardedDataParallelPlugin
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    words = [f"w{i}" for i in range(250)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(256)]
    import torch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    args = SFTConfig(output_dir=str(out / "ckpt"), per_device_train_batch_size=4, gradient_accumulation_steps=MICRO,
                     max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                     ddp_backend="gloo", disable_tqdm=True, seed=0, max_length=64, fsdp="full_shard auto_wrap",
                     fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                  "reshard_after_forward": True})
    tr = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}), processing_class=tok,
                    callbacks=callbacks)
    st = tr.accelerator.state  # (as on a GPU: the plugin from the arguments, the state FSDP)
    st.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    force_fsdp(st)
    tr.is_fsdp_enabled = True
    return tr


def run_sft(out: Path) -> dict:
    """The SFTTrainer recorded (DoctorCallback, its default profiler window), then again with prefetch.sync_unshard's
    fix pasted as printed: each run's outcome, its arguments' class as recorded, its losses, and each of this rank's
    collectives outside FSDP's own in the trace, [collective, phase, calls per step]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    res = {}
    for name in ("sft", "sft_fixed"):
        tr = sft_trainer(out / f"hf_{name}", [fsdp_doctor.DoctorCallback(out_dir=str(out / name))])
        if name == "sft_fixed":
            code = res["sft"]["findings"]["prefetch.sync_unshard"]["code"]
            exec(compile(code, "<prefetch.sync_unshard fix>", "exec"), {"trainer": tr})
        tr.train()
        dist.barrier()
        run = fsdp_doctor.load_run(out / name)
        rows = fsdp_doctor.build_report(run).overlap.per_unit
        res[name] = {**_outcome(out / name, rank), "trainer_args": run.ranks[rank].config.trainer_args,
                     "losses": [h["loss"] for h in tr.state.log_history if "loss" in h],
                     "other": sorted(([r.collective, r.phase, r.count_per_step] for r in rows
                                      if r.unit == "(other)" and r.rank == rank), key=str)}
    return res


CASES = {"sft": run_sft}


if __name__ == "__main__":
    sys.path[:0] = [str(TRL_SITE), str(TITAN_SITE)]  # (the rank processes only: the test process never imports trl)
    from clients import main

    sys.exit(main(sys.argv[1:], CASES))
