"""OLMo-core, a real client of the tests: its Trainer (AI2's FSDP2 training library: its train module shards the
model in Transformer.apply_fsdp from TransformerDataParallelConfig and runs the micro-batches itself) recorded with
fsdp_doctor.olmo.DoctorCallback, on gloo ranks, as its users attach it (``trainer.add_callback``).

OLMo-core is installed with what it imports, torch aside, into a folder of its own (Makefile: OLMO_SITE) that only
these ranks put on their path. The model: its olmo2 family (``TransformerConfig.olmo2_30M``, 4 blocks, vocabulary
2,000 padded to 2,048), sequences of 128 tokens from a file of seeded random tokens, 4 sequences a micro-batch on each
rank, 2 micro-batches a step (16 sequences a global batch), AdamW, gradient clipping.

A case: ``python tests/olmo_cases.py CASE RANK WORLD PORT OUT`` (tests/test_olmo.py launches it), then
``CASE_fixed`` in the same OUT: each RESULT is the run's outcome (recorder_cases._outcome) and a digest of the trained
parameters, the second run's with the fixes the first's diagnosis printed pasted where they say: the config settings
before the train module is built (``train_module_config``), the rest after (``train_module``) or, on its
checkpointer, after the Trainer is built (``trainer``). ``pipeline``: its pipeline-parallel train module, which the
callback refuses in one line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: where `make setup` installs OLMo-core (Makefile: OLMO_SITE)
OLMO_SITE = Path(os.environ.get("FSDP_DOCTOR_OLMO_SITE", ROOT / ".venv" / "olmo"))

import torch.distributed as dist

import fsdp_doctor
from recorder_cases import _outcome, report_findings, torchrun_env

#: optimizer steps a run (the doctor's profiler window: steps 6-7), sequence length, micro-batches a step
STEPS, SEQ, MICRO = 10, 128, 2
#: each case's OLMo-core settings (train()'s); it runs as "CASE", then as "CASE_fixed" with the first run's fixes
CASES = {
    # the default wrapping (each block, the embedding and the LM head), saving every 5 steps synchronously: the
    # accumulation, prefetch, optimizer and checkpoint fixes
    "full": {"save_every": 5},
    # blocks only (the LM head left in the root) under a budget below the peak: wrapping and checkpointing fixes
    "blocks_tight": {"wrap": "blocks", "capacity_mib": 100},
    # every block checkpointed with room to spare: checkpointing off, and the micro-batches' regather and ZeRO-2
    "ac_loose": {"ac": "full", "capacity_mib": 400},
    # OLMo-core's in-loop evaluation (its LM evaluator, 8 batches every 3 steps: the fix's gain twice the rule's 2% of
    # the step, where 4 batches made it 2.6-3.0%), with room to spare: the units kept gathered through each evaluation
    "eval": {"eval_every": 3, "capacity_mib": 400},
    # no doctor: OLMo-core's own ProfilerCallback (a trace of steps 4-5, rank 0's), its trace's fixes pasted
    "profiled": {"profiler": True},
    # HSDP on 4 ranks (2 replicas of 2 shards; the global batch one micro-batch a rank), 200 MiB: the unshard, the
    # optimizer and ZeRO-2 fixes
    "hsdp": {"replicas": 2, "capacity_mib": 200},
}
#: ranks a case runs on (others: 2)
WORLD = {"hsdp": 4}
#: the findings whose fixes a case's second run pastes, where not all: under blocks_tight's budget the accumulation
#: fix's unsharded gradients (+8.5 MiB) bring checkpointing back (a trial's peak, all pasted: 88.4 MiB of 100)
PASTED = {"blocks_tight": ("wrap.params_in_root", "ac.recommended"), "eval": ("eval.regather",)}
#: the metric OLMo-core 3.0.0's Trainer records when an asynchronous save completes, from the save future's callback:
#: on a rank whose save finished before the run's last metrics flush it goes out with that flush, on one whose save
#: finished after it, at shutdown, where the Trainer reduces its metrics only on ranks that hold any: that rank waits
#: in an all-reduce the other never joins (py-spy: rank 0 in reduce_metrics' all_reduce, rank 1 at the shutdown
#: barrier). Its saves end that near the run's last step only on a model as small as these: 2 of 5 runs without the
#: doctor hung so, and every run where rank 1 was held 3 s in its last post_step; none with the metric dropped
ASYNC_SAVE_METRIC = "checkpoint/save_async_duration_s"


def tokens_file(out: Path) -> Path:
    """400,000 seeded random tokens in [2, 2000), as OLMo-core's numpy datasets read them (uint16), written once."""
    import numpy as np

    path = out / "tokens.npy"
    if dist.get_rank() == 0 and not path.exists():
        np.random.default_rng(0).integers(2, 2000, size=400_000, dtype=np.uint16).tofile(path)
    dist.barrier()
    return path


def eval_tokens_file(out: Path) -> Path:
    """64 seeded random documents of SEQ tokens, each ending in the EOS token, as OLMo-core's padded datasets read
    them, written once."""
    import numpy as np

    path = out / "eval_tokens.npy"
    if dist.get_rank() == 0 and not path.exists():
        docs = np.random.default_rng(1).integers(2, 2000, size=(64, SEQ), dtype=np.uint16)
        docs[:, -1] = 1
        docs.reshape(-1).tofile(path)
    dist.barrier()
    return path


def train(out: Path, name: str, wrap: str = "full", ac: str | None = None, capacity_mib: float | None = None,
          save_every: int | None = None, eval_every: int | None = None, profiler: bool = False,
          replicas: int | None = None, cfg_fix: str = "", built_fix: str = "", trainer_fix: str = "",
          doctor: bool = True) -> tuple[float, list[str]]:
    """One OLMo-core run recorded into ``out/name``, ``cfg_fix`` run with its train module's config built and
    ``built_fix`` with the train module built, ``trainer_fix`` with the Trainer built (each as a user pastes it);
    ``save_every``: its checkpointer's save interval, in steps (none: a save before the first step and after the
    last alone), its saves synchronous unless ``trainer_fix`` turns them asynchronous (then without the metric
    OLMo-core's race hangs on: ASYNC_SAVE_METRIC); ``eval_every``: its LM evaluator's interval, in steps (8 batches of
    a file of its own each time, all of it; none: no evaluation); ``profiler``: OLMo-core's ProfilerCallback, without
    the doctor (its trace: ``profiler_trace``); ``replicas``: HSDP over that many replicas (none: FSDP over all
    ranks); ``doctor`` False: trained without the doctor.
    Returns the digest of the trained parameters (the sum of every full parameter, in float64) and what the doctor
    left on the Trainer after training (its attributes)."""
    import torch
    from olmo_core.config import DType
    from olmo_core.data import (NumpyDataLoaderConfig, NumpyFSLDatasetConfig, NumpyPaddedFSLDatasetConfig,
                                TokenizerConfig)
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback, LMEvaluatorCallbackConfig, ProfilerCallback
    from olmo_core.train.train_module import (TransformerActivationCheckpointingConfig,
                                              TransformerDataParallelConfig, TransformerTrainModuleConfig)
    from olmo_core.utils import seed_all

    from fsdp_doctor.olmo import DoctorCallback
    from fsdp_doctor.record.olmo_trainer import SAVES

    seed_all(0)
    tok = TokenizerConfig(vocab_size=2000, eos_token_id=1, pad_token_id=0)
    model = TransformerConfig.olmo2_30M(vocab_size=tok.padded_vocab_size()).build(init_device="meta")
    train_module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=4 * SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=1e-3), max_grad_norm=1.0,
        dp_config=TransformerDataParallelConfig(name=DataParallelType.hsdp if replicas else DataParallelType.fsdp,
                                                num_replicas=replicas, reduce_dtype=DType.float32,
                                                wrapping_strategy=wrap),
        ac_config=TransformerActivationCheckpointingConfig(mode=ac) if ac else None)
    exec(compile(cfg_fix, "<the doctor's config fixes>", "exec"), {"train_module_config": train_module_config})
    train_module = train_module_config.build(model)
    exec(compile(built_fix, "<the doctor's fixes after the build>", "exec"), {"train_module": train_module})
    dataset = NumpyFSLDatasetConfig(paths=[str(tokens_file(out))], sequence_length=SEQ, tokenizer=tok,
                                    work_dir=str(out / "work")).build()
    loader = NumpyDataLoaderConfig(global_batch_size=8 * MICRO * SEQ, seed=0, num_workers=0).build(
        dataset, dp_process_group=train_module.dp_process_group)
    trainer_config = TrainerConfig(save_folder=str(out / f"save_{name}"), save_overwrite=True,
                                   max_duration=Duration.steps(STEPS), metrics_collect_interval=5,
                                   cancel_check_interval=5)
    trainer_config = trainer_config.with_callback("checkpointer", CheckpointerCallback(
        save_interval=save_every or 100 * STEPS, save_async=False))
    if eval_every:
        trainer_config = trainer_config.with_callback("lm_evaluator", LMEvaluatorCallbackConfig(
            eval_dataset=NumpyPaddedFSLDatasetConfig(paths=[str(eval_tokens_file(out))], metadata=[{"label": "val"}],
                                                     sequence_length=SEQ, tokenizer=tok, work_dir=str(out / "work")),
            eval_interval=eval_every, eval_duration=Duration.steps(8)))
    trainer = trainer_config.build(train_module, loader)
    exec(compile(trainer_fix, "<the doctor's fixes on the Trainer>", "exec"), {"trainer": trainer})
    if trainer.callbacks["checkpointer"].save_async:  # (checkpoint.blocking's fix pasted: OLMo-core's race aside)
        record = trainer.record_metric
        trainer.record_metric = lambda name, *a, **k: None if name == ASYNC_SAVE_METRIC else record(name, *a, **k)
    options = {"capacity_bytes": int(capacity_mib * 2**20)} if capacity_mib else {}
    if profiler:  # (as its users profile: with_stack, its default, records the Python frames that name its Trainer)
        trainer.add_callback("profiler", ProfilerCallback(wait=1, warmup=2, active=2))
    elif doctor:
        trainer.add_callback("fsdp_doctor", DoctorCallback(out_dir=str(out / name), **options))
    trainer.fit()
    left = [n for n in SAVES if n in vars(trainer)]  # (the save methods it wraps while it watches)
    return sum(float(p.full_tensor().double().sum()) for p in train_module.model.parameters()), left


def fixes(findings: dict, where: str) -> str:
    """The printed fixes of ``findings`` that go ``where`` ("olmo_config", "olmo_built", "olmo_trainer"), one after
    the other."""
    return "\n\n".join(f["code"] for f in findings.values() if f["where"] == where)


def profiler_trace(out: Path, name: str) -> Path:
    """The folder of the trace OLMo-core's ProfilerCallback wrote in run ``name`` (rank 0's: its default ranks)."""
    return out / f"save_{name}" / "profiler"


def trace_outcome(out: Path, name: str) -> dict:
    """Run ``name``'s trace read back: its findings and quiet rules (recorder_cases.report_findings), what drove it
    by the trace."""
    rep = fsdp_doctor.build_report(fsdp_doctor.load_run(profiler_trace(out, name)))
    return {**report_findings(rep), "drivers": sorted({str(pr.driver) for pr in rep.overlap.per_rank.values()})}


def run_case(name: str, out: Path) -> dict:
    """One run of a case (CASES) in ``out``: "CASE" as it is, "CASE_fixed" (launched after it, in a process of its own:
    OLMo-core builds one world mesh a process) with every fix of CASE's diagnosis pasted where it says, "CASE_plain"
    as it is without the doctor. Returns the run's outcome, parameter digest and what the doctor left on the
    Trainer."""
    rank, world = torchrun_env()
    case = name.removesuffix("_fixed").removesuffix("_plain")
    if name.endswith("_plain"):  # (no doctor: the digest to compare)
        return {"digest": train(out, name, **CASES[case], doctor=False)[0]}
    traced = CASES[case].get("profiler")  # (its findings the trace's, the first run's rank 0's)
    found = ({} if name == case else trace_outcome(out, case)["findings"] if traced
             else _outcome(out / case, rank)["findings"])
    found = {k: v for k, v in found.items() if k in PASTED.get(case, found)}
    digest, left = train(out, name, **CASES[case], cfg_fix=fixes(found, "olmo_config"),
                         built_fix=fixes(found, "olmo_built"), trainer_fix=fixes(found, "olmo_trainer"))
    dist.barrier()
    if traced:
        return {"digest": digest, **trace_outcome(out, name)}
    rd = fsdp_doctor.load_run(out / name).ranks[rank]
    return {"digest": digest, "left": left, "saved_steps": [s.step for s in rd.steps if s.checkpoint_ms],
            "async_saves": sum(s.async_saves for s in rd.steps), "mesh": rd.config.mesh, **_outcome(out / name, rank)}


def pipeline_refusal(out: Path) -> dict:
    """OLMo-core's pipeline-parallel train module (2 stages over the 2 ranks, its custom interleaved 1F1B schedule)
    built and its Trainer's callbacks started as ``fit()`` starts them; training itself is not run (its schedule
    needs CUDA streams). Returns what the doctor said (its log lines), whether it watches, and what it wrote."""
    import logging

    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.distributed.parallel.pipeline_parallel import PipelineScheduleType
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig
    from olmo_core.train.train_module.transformer.config import TransformerPipelineParallelConfig

    from fsdp_doctor.olmo import DoctorCallback

    _, world = torchrun_env()
    tok = TokenizerConfig(vocab_size=2000, eos_token_id=1, pad_token_id=0)
    model = TransformerConfig.olmo2_30M(vocab_size=tok.padded_vocab_size()).build(init_device="meta")
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=4 * SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=1e-3),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp),
        pp_config=TransformerPipelineParallelConfig(degree=world, use_custom_stage_implementation=True,
                                                    schedule=PipelineScheduleType.custom_interleaved_1F1B),
    ).build(model)
    dataset = NumpyFSLDatasetConfig(paths=[str(tokens_file(out))], sequence_length=SEQ, tokenizer=tok,
                                    work_dir=str(out / "work")).build()
    loader = NumpyDataLoaderConfig(global_batch_size=8 * MICRO * SEQ, seed=0, num_workers=0).build(
        dataset, dp_process_group=train_module.dp_process_group)
    trainer = TrainerConfig(save_folder=str(out / "save_pipeline"), save_overwrite=True,
                            max_duration=Duration.steps(STEPS)).build(train_module, loader)
    callback = DoctorCallback(out_dir=str(out / "pipeline"))
    trainer.add_callback("fsdp_doctor", callback)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("fsdp_doctor").addHandler(handler)
    try:
        callback.pre_train()
    finally:
        logging.getLogger("fsdp_doctor").removeHandler(handler)
    return {"said": said, "watching": callback.doctor is not None, "wrote": (out / "pipeline").exists(),
            "parts": len(train_module.model_parts)}


CLIENTS = {name: (lambda out, name=name: run_case(name, out))
           for case in CASES for name in (case, f"{case}_fixed", f"{case}_plain")}
CLIENTS["pipeline"] = pipeline_refusal


if __name__ == "__main__":
    sys.path[:0] = [str(OLMO_SITE)]  # (the rank processes only: the test process never imports olmo_core)
    from clients import main

    sys.exit(main(sys.argv[1:], CLIENTS))
