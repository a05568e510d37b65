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
from recorder_cases import _outcome, torchrun_env, trainer_fsdp
from titan_cases import TITAN_SITE

#: the case's optimizer steps (the doctor's profiler window: steps 6-7) and micro-batches a step
STEPS, MICRO = 10, 2


WORDS = [f"w{i}" for i in range(250)]


def llama_and_tokenizer():
    """A 4-layer Llama (width 256, 4 heads over 2 KV heads, seeded) and a word-level tokenizer of WORDS (253 tokens
    with its pad, end and unknown tokens)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    return model, tok


def sft_trainer(out: Path, callbacks: list):
    """TRL's SFTTrainer of llama_and_tokenizer()'s Llama on 256 texts of 20-60 WORDS, 4 sequences of at most 64
    tokens a micro-batch, MICRO micro-batches a step, sharded by the FSDP2 plugin the Trainer makes from
    ``fsdp_config`` (each decoder layer a unit)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tok = llama_and_tokenizer()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(256)]
    args = SFTConfig(output_dir=str(out / "ckpt"), per_device_train_batch_size=4, gradient_accumulation_steps=MICRO,
                     max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                     ddp_backend="gloo", disable_tqdm=True, seed=0, max_length=64, fsdp="full_shard auto_wrap",
                     fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                  "reshard_after_forward": True})
    tr = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}), processing_class=tok,
                    callbacks=callbacks)
    trainer_fsdp(tr)
    return tr


def run_sft(out: Path) -> dict:
    """The SFTTrainer recorded (DoctorCallback, its default profiler window), then again with prefetch.sync_unshard's
    fix pasted as printed: each run's outcome, its arguments' class as recorded, its losses, and each of this rank's
    collectives outside FSDP's own in the trace, [collective, phase, calls per step]."""
    rank, world = torchrun_env()
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


def dpo_trainer(out: Path, ckpt: Path, callbacks: list, fix: str = ""):
    """TRL's DPOTrainer of the same Llama, saved at ``ckpt`` and loaded from there (TRL builds the reference model
    from the policy's checkpoint), on 128 preference pairs of 8-24 words, MICRO micro-batches of 4 pairs a step. The
    accelerator is FSDP from its start, as on a GPU, where DPOTrainer shards the reference in its __init__
    (trl.models.prepare_fsdp: one fully_shard call on the whole model). ``fix``: wrap.reference_one_unit's, run as
    printed with the policy built, its ``ref_model`` passed to the trainer."""
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, Trainer
    from trl import DPOConfig, DPOTrainer

    tok = PreTrainedTokenizerFast.from_pretrained(str(ckpt))
    rng = random.Random(0)
    text = lambda a, b: " ".join(rng.choice(WORDS) for _ in range(rng.randint(a, b)))  # noqa: E731
    pairs = Dataset.from_dict({k: [text(8, 20 if k == "prompt" else 24) for _ in range(128)]
                               for k in ("prompt", "chosen", "rejected")})
    args = DPOConfig(output_dir=str(out / "ckpt"), per_device_train_batch_size=4, gradient_accumulation_steps=MICRO,
                     max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                     ddp_backend="gloo", disable_tqdm=True, seed=0, max_length=64, fsdp="full_shard auto_wrap",
                     fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                  "reshard_after_forward": True})
    made = Trainer.create_accelerator_and_postprocess

    def as_on_a_gpu(self):  # (the state FSDP before the reference is prepared, in DPOTrainer.__init__)
        made(self)
        trainer_fsdp(self)

    model = LlamaForCausalLM.from_pretrained(str(ckpt))
    kw = {}
    if fix:
        ns = {"model": model}
        exec(compile(fix, "<wrap.reference_one_unit fix>", "exec"), ns)
        kw["ref_model"] = ns["ref_model"]
    Trainer.create_accelerator_and_postprocess = as_on_a_gpu
    try:
        return DPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tok, callbacks=callbacks,
                          **kw)
    finally:
        Trainer.create_accelerator_and_postprocess = made


def run_dpo(out: Path) -> dict:
    """The DPOTrainer recorded, its reference sharded by TRL; then with wrap.reference_one_unit's fix pasted as
    printed: each run's outcome, its losses and how many FSDPModules the reference has."""
    from torch.distributed.fsdp import FSDPModule

    rank, world = torchrun_env()
    ckpt = out / "policy"
    if rank == 0:  # the policy's checkpoint (a tokenizer of its own beside it): TRL builds the reference from it
        model, tok = llama_and_tokenizer()
        model.save_pretrained(str(ckpt))
        tok.save_pretrained(str(ckpt))
    dist.barrier()
    res = {}
    for name in ("dpo", "dpo_fixed"):
        fix = res["dpo"]["findings"]["wrap.reference_one_unit"]["code"] if name == "dpo_fixed" else ""
        tr = dpo_trainer(out / f"hf_{name}", ckpt, [fsdp_doctor.DoctorCallback(out_dir=str(out / name))], fix)
        tr.train()
        dist.barrier()
        res[name] = {**_outcome(out / name, rank), "losses": [h["loss"] for h in tr.state.log_history if "loss" in h],
                     "reference_units": sum(isinstance(m, FSDPModule) for m in tr.ref_model.modules())}
    return res


CASES = {"sft": run_sft, "dpo": run_dpo}


if __name__ == "__main__":
    sys.path[:0] = [str(TRL_SITE), str(TITAN_SITE)]  # (the rank processes only: the test process never imports trl)
    from clients import main

    sys.exit(main(sys.argv[1:], CASES))
