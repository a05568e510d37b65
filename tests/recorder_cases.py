"""The recorder leaves training alone and leaves nothing behind (tests/test_recorder_cases.py starts the ranks,
one gloo rank per process; each prints one ``RESULT {json}`` line).

Cases:
  identity  an HF Llama (SiLU, grouped-query SDPA attention, built from a tiny LlamaConfig) and the reference GPT
            (GELU), fp32 and bf16 mixed precision: losses and final parameter shards without the doctor against
            the same run watched with every option (FLOP counting via tokens_per_step / peak_tflops / count_flops,
            each memory sampling mode, a profiler window over the counted step, no profiler); after each watched
            run the hook state (every module's hook dictionaries, the parameters', the optimizer's, the global
            module and optimizer hooks, gc callbacks, the FSDP logger, saved-tensor hooks, dispatch modes) is the
            one before watch().
  aside     the doctor stepping aside (an exception in its hook, a full disk, the run directory deleted, an
            unexpected exception inside __enter__) leaves the hook state as before, at once; accelerate's
            AcceleratedOptimizer is unwrapped; doctor.step() per micro-batch gives one step per optimizer step;
            HF gradient checkpointing: model FLOPs as without it, hardware FLOPs higher.
  trainer   a Hugging Face Trainer with fsdp_doctor.DoctorCallback (run_trainer).
  trainer_fixes  fixes whose lever is the Trainer's own setting, diagnosed and pasted (run_trainer_fixes).
  trainer_gc  a Trainer whose callback keeps many objects alive: jitter.gc's callback pasted (run_trainer_gc).
  accelerate_accum  gradient accumulation inside accelerator.accumulate(model), its plugin's defaults and
            sync_each_batch=True, the latter's fix pasted (run_accelerate_accum).
  optimizers  several optimizers on the reference GPT: torchtune's optimizer_in_bwd (a per-parameter AdamW stepped
            by a hook as FSDP2 reduce-scatters each gradient), watched with the map of them and with None
            (run_in_backward); Muon on the blocks' matrices beside AdamW on the rest, both stepped in the loop,
            watched with the list of them (run_two_optimizers).

Usage: python tests/recorder_cases.py CASE RANK WORLD PORT OUT_DIR
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import shutil
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import msgspec
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_doctor
from fsdp_doctor import ProfileSchedule

STEPS = 5
SEQ = 16
BATCH = 2
VOCAB = 128
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
OPT_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
             "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
             "_optimizer_load_state_dict_post_hooks")


def torchrun_env() -> tuple[int, int]:
    """This rank's (rank, world size), set in the environment as torchrun sets it, where a client reads them
    (accelerate, transformers' Trainer, TRL, OLMo-core)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    return rank, world


# ------------------------------------------------------------------------------------------------ models
def llama_config(width: int = 64, **kw):
    """The cases' tiny HF Llama: 2 layers (unless ``kw`` says), 4 heads over 2 KV heads, ``width`` wide (its MLP
    twice that)."""
    from transformers import LlamaConfig

    kw = {"max_position_embeddings": 2 * SEQ, "num_hidden_layers": 2, **kw}
    return LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
                       num_key_value_heads=2, **kw)


def llama(param_dtype=None, checkpointing: bool = False):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(attn_implementation="sdpa"))
    if checkpointing:
        model.gradient_checkpointing_enable()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, lambda tok: model(input_ids=tok).logits


def gpt(param_dtype=None, checkpointing: bool = False):
    from fsdp_doctor.workloads import WorkloadConfig, build_model
    from fsdp_doctor.workloads.sharding import apply_activation_checkpointing, apply_fsdp

    cfg = WorkloadConfig(vocab=VOCAB, d_model=64, n_layers=2, n_heads=4, seq_len=SEQ, batch_size=BATCH,
                         param_dtype="bf16" if param_dtype is torch.bfloat16 else None,
                         ac="block" if checkpointing else "none")
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_activation_checkpointing(model, cfg)
    apply_fsdp(model, cfg)
    return model, model


MODELS = {"llama": llama, "gpt": gpt}


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * dist.get_rank() + micro)
    tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def train(build, *, out_dir=None, watch_kw=None, steps=STEPS, micro=1, wrap=None, during=None):
    """The user's loop. ``during(step, doctor, out_dir)`` runs before each step's forward (to break the doctor);
    returns (losses, final local parameter shards, hook state after the run, doctor, hook state before)."""
    model, forward = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    user_opt = wrap(opt) if wrap else opt
    model._get_fsdp_state()._lazy_init()  # FSDP's own lazy init adds state-dict hooks: the state to compare with
    before = hook_state(model, opt)
    ctx = fsdp_doctor.watch(model, user_opt, out_dir=str(out_dir), **(watch_kw or {})) if out_dir else None
    doctor = ctx.__enter__() if ctx else None
    losses, states = [], []
    try:
        for step in range(steps):
            if during is not None:
                during(step, doctor, out_dir)
            total = 0.0
            for m in range(micro):
                tok, tgt = batch(step, m)
                loss = F.cross_entropy(forward(tok).float().flatten(0, 1), tgt.flatten()) / micro
                loss.backward()
                total += loss.item()
                if doctor is not None and micro > 1 and m < micro - 1:
                    doctor.step()  # the user's doctor.step() per micro-batch
            user_opt.step()
            user_opt.zero_grad()
            if doctor is not None:
                doctor.step()
                states.append(hook_state(model, opt))
            losses.append(total)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    params = [p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
              for p in model.parameters()]
    return losses, params, hook_state(model, opt), doctor, before, states


# ------------------------------------------------------------------------------------------------ hook state
def hook_state(model, opt) -> dict:
    """Everything a recorder could leave behind, as comparable values (hook ids, callables' ids)."""
    import torch.nn.modules.module as M
    import torch.optim.optimizer as O

    from fsdp_doctor.record import fsdp2 as F2

    def keys(d):
        return sorted(d.keys()) if d else []

    out = {}
    for name, m in model.named_modules():
        out["module " + name] = {k: keys(getattr(m, k, None)) for k in HOOK_DICTS}
    for name, p in model.named_parameters():
        out["param " + name] = [keys(getattr(p, "_backward_hooks", None)),
                                keys(getattr(p, "_post_accumulate_grad_hooks", None))]
    out["optimizer"] = {k: keys(getattr(opt, k, None)) for k in OPT_DICTS}
    out["global module"] = [keys(getattr(M, k)) for k in
                            ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                             "_global_backward_pre_hooks", "_global_module_registration_hooks")]
    out["global optimizer"] = [keys(O._global_optimizer_pre_hooks), keys(O._global_optimizer_post_hooks)]
    out["gc callbacks"] = [id(c) for c in gc.callbacks]
    lg = logging.getLogger(F2.LOGGER_NAME)
    out["fsdp logger"] = [id(lg.__dict__.get("debug")), lg.level, [id(h) for h in lg.handlers]]
    lg = F2.dcp_logger()
    out["checkpoint logger"] = [lg.level, [id(h) for h in lg.handlers]]
    lg = F2.dynamo_logger()
    out["dynamo logger"] = [lg.level, [id(h) for h in lg.handlers]]
    out["saved tensor hooks"] = F2.saved_hooks_top() is not None
    out["dispatch modes"] = torch._C._len_torch_dispatch_stack()
    out["function modes"] = torch._C._len_torch_function_stack()  # (the first forward's parameter reads' mode)
    out["profiler"] = torch.autograd.profiler._is_profiler_enabled
    return out


def diff(a: dict, b: dict) -> list[str]:
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------ cases
def option_sets(world: int) -> dict:
    tokens = BATCH * SEQ * world
    return {
        "tokens+peak, memory auto, profiler over the counted step": dict(
            tokens_per_step=tokens, peak_tflops=1.0, memory=True,
            profile=ProfileSchedule(first=1, active=2, warmup=1, every=0)),
        "count_flops, memory every step, no profiler": dict(count_flops=True, memory={"full_every": 1},
                                                            profile=False),
        "tokens, memory off, a profiler window after the counted step": dict(
            tokens_per_step=tokens, memory=False, profile=ProfileSchedule(first=3, active=1, warmup=0, every=0)),
    }


def run_identity(out: Path) -> dict:
    res = {"mismatch": [], "left_behind": {}, "flops": {}}
    for name, build in MODELS.items():
        for dt_name, dt in (("fp32", None), ("bf16", torch.bfloat16)):
            base_losses, base_params, *_ = train(lambda: build(dt), steps=4)
            for i, (label, kw) in enumerate(option_sets(dist.get_world_size()).items()):
                run_dir = out / f"{name}-{dt_name}-{i}"
                losses, params, after, doctor, before, _ = train(lambda: build(dt), out_dir=run_dir, watch_kw=kw,
                                                                 steps=4)  # counted at 1, windows at 1-2 and 3
                case = f"{name} {dt_name} [{label}]"
                if losses != base_losses or not same_tensors(params, base_params):
                    res["mismatch"].append(case)
                if diff(before, after):
                    res["left_behind"][case] = diff(before, after)
                res["flops"][case] = [doctor.flops_per_step, doctor.hardware_flops_per_step]
    return res


def run_aside(out: Path) -> dict:
    res = {}
    world = dist.get_world_size()
    base_losses, base_params, *_ = train(gpt)

    def check(case, during, steps=STEPS, **kw):
        losses, params, after, doctor, before, states = train(gpt, out_dir=out / case, during=during, steps=steps,
                                                              watch_kw=dict(profile=False, **kw))
        res[case] = {"identical": losses == base_losses[:steps] and (steps < STEPS or same_tensors(params, base_params)),
                     "left_after_exit": diff(before, after),
                     # the state after each step: the doctor steps aside at step 2, so steps 2-4 must equal before
                     "left_after_aside": [diff(before, s) for s in states[2:]],
                     "active": doctor.active}

    def hook_error(step, doctor, out_dir):
        if step == 2:
            doctor._acc[1] = None  # the next hook that touches it raises inside the doctor

    def full_disk(step, doctor, out_dir):
        if step == 2:
            def write(*recs):
                raise OSError(28, "No space left on device")
            doctor._sinks.writer.write = write

    def deleted(step, doctor, out_dir):
        if step == 2:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(out_dir)
            dist.barrier()

    check("hook error", hook_error)
    check("full disk", full_disk)
    check("deleted out_dir", deleted)

    # an unexpected exception inside __enter__: one line, training goes on, nothing installed
    import fsdp_doctor.record.tracker as T

    real = T.run_device

    def broken(units):
        raise RuntimeError("unexpected")

    T.run_device = broken
    try:
        check("enter fails", None)
    finally:
        T.run_device = real

    # None without accelerate (the GPU machine has none): its test skips, the other cases still run
    res["accelerate"] = run_accelerate(out) if importlib.util.find_spec("accelerate") is not None else None

    res["dcp"] = run_dcp_saves(out, base_losses)

    # gradient accumulation with doctor.step() per micro-batch: 12 optimizer steps x 4 micro-batches
    train(gpt, out_dir=out / "micro", steps=12, micro=4, watch_kw=dict(profile=False))
    rd = fsdp_doctor.load_run(out / "micro").ranks[dist.get_rank()]
    res["micro"] = {"steps": [s.step for s in rd.steps], "micro_batches": [s.micro_batches for s in rd.steps],
                    "optimizer_ms": [s.optimizer_ms for s in rd.steps], "errors": [e.message for e in rd.errors],
                    "memory": [s.memory is not None for s in rd.steps]}

    # activation checkpointing (HF gradient_checkpointing_enable, the reference GPT's checkpoint_wrapper per
    # block): model FLOPs equal, hardware FLOPs higher by the recompute
    for name in ("llama", "gpt"):
        flops = {}
        for ck in (False, True):
            *_, doctor, _, _ = train(lambda: MODELS[name](checkpointing=ck), out_dir=out / f"{name}-ckpt-{ck}",
                                     steps=3, watch_kw=dict(profile=False, memory=False, peak_tflops=1e-3,
                                                            tokens_per_step=BATCH * SEQ * world))
            flops[str(ck)] = [doctor.flops_per_step, doctor.hardware_flops_per_step]
        res[f"{name}_checkpointing"] = flops  # (peak: a CPU's order of magnitude)
    return res


def run_dcp_saves(out: Path, base_losses: list[float]) -> dict:
    """torch.distributed.checkpoint's saves before the forward of steps 1 and 3, as users write them: dcp.save
    unmarked, dcp.save inside doctor.checkpointing(), dcp.async_save (its background collectives on a gloo group of
    their own, as gloo needs). Each step's record: its saves, asynchronous ones, save time, time outside."""
    import torch.distributed.checkpoint as dcp

    group = dist.new_group(backend="gloo")
    res = {}
    for how in ("save", "marked", "async_save", "model_and_optimizer"):
        futures = []

        def save(step, doctor, out_dir, how=how, futures=futures):
            if step not in (1, 3):
                return
            sd, where = {"model": doctor.model.state_dict()}, str(out / f"ckpt-{how}-{step}")
            if how == "save":
                dcp.save(sd, checkpoint_id=where)
            elif how == "marked":
                with doctor.checkpointing():
                    dcp.save(sd, checkpoint_id=where)
            elif how == "model_and_optimizer":  # accelerate's save_state: a dcp.save each, one after the other
                dcp.save(sd, checkpoint_id=where)
                dcp.save({"second": doctor.model.state_dict()}, checkpoint_id=where + "-second")
            else:
                futures.append(dcp.async_save(sd, checkpoint_id=where, process_group=group))

        losses, _, after, doctor, before, _ = train(gpt, out_dir=out / f"dcp-{how}", during=save,
                                                    watch_kw=dict(profile=False))
        for f in futures:
            f.result()
        rd = fsdp_doctor.load_run(out / f"dcp-{how}").ranks[dist.get_rank()]
        res[how] = {"identical": losses == base_losses, "left_after_exit": diff(before, after),
                    "checkpoints": [s.checkpoints for s in rd.steps], "async_saves": [s.async_saves for s in rd.steps],
                    "checkpoint_ms": [s.checkpoint_ms for s in rd.steps],
                    # the step's wall less what is not its time outside the model
                    "rest_ms": [s.wall_ms - s.forward_ms - s.backward_ms - s.optimizer_ms - s.no_grad_ms - s.doctor_ms
                                for s in rd.steps], "outside_ms": [s.outside_ms for s in rd.steps],
                    "errors": [e.message for e in rd.errors]}
    return res


def run_accelerate(out: Path) -> dict:
    """accelerate's own FSDP2 path: ``Accelerator`` with its FSDP2 plugin (forced to FSDP: accelerate enables it
    on GPUs only), ``accelerator.prepare(model, optimizer)`` shards an HF Llama and wraps the optimizer in an
    AcceleratedOptimizer, ``accelerator.backward``; the same run without and with the doctor."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from transformers import LlamaForCausalLM

    rank, world = torchrun_env()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            reshard_after_forward=True)
    acc = Accelerator(cpu=True)


    def run(out_dir=None):
        force_fsdp(acc.state, plugin)  # (prepare resets AcceleratorState's alone)
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config())
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        inner = opt.optimizer
        model._get_fsdp_state()._lazy_init()
        before = hook_state(model, inner)
        ctx = fsdp_doctor.watch(model, opt, out_dir=str(out_dir), profile=False) if out_dir else None
        doctor = ctx.__enter__() if ctx else None
        losses = []
        for step in range(STEPS):
            tok, tgt = batch(step)
            loss = model(input_ids=tok, labels=tok).loss  # HF shifts the labels itself
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if doctor is not None:
                doctor.step()
            losses.append(loss.item())
        if ctx is not None:
            ctx.__exit__(None, None, None)
        params = [p.to_local().detach().clone() for p in model.parameters()]
        return losses, params, diff(before, hook_state(model, inner)), type(opt).__name__

    base, base_params, _, _ = run()
    losses, params, left, wrapper = run(out / "accelerate")
    rd = fsdp_doctor.load_run(out / "accelerate").ranks[rank]
    return {"identical": losses == base and same_tensors(params, base_params), "left": left, "wrapper": wrapper,
            "optimizer": rd.config.optimizer, "units": len(rd.config.units),
            "optimizer_ms": [s.optimizer_ms for s in rd.steps], "errors": len(rd.errors)}


class _VLItems(torch.utils.data.Dataset):
    """The Trainer's Qwen2.5-VL case's data: ``n`` samples of an image and text (clients.qwen_vl_item, seeded by
    index)."""

    def __init__(self, n, seed):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import clients

        return clients.qwen_vl_item(torch.Generator().manual_seed(self.seed + i))


class _Tokens(torch.utils.data.Dataset):
    """The Trainer cases' data: ``n`` sequences of SEQ random tokens (seeded by index), ``slow_ms`` each to make."""

    def __init__(self, n, seed, slow_ms=0.0, seq=SEQ):
        self.n, self.seed, self.slow_ms, self.seq = n, seed, slow_ms, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.slow_ms / 1000)  # a slow data pipeline (reading, decoding, tokenising)
        t = torch.randint(0, VOCAB, (self.seq,), generator=torch.Generator().manual_seed(self.seed + i))
        return {"input_ids": t, "labels": t}


def trainer_hooks():
    """A Trainer callback (a new instance per Trainer) that keeps the hook state when training starts (the model
    is sharded by then), and forces accelerate's state back to FSDP there."""
    from accelerate.state import AcceleratorState
    from transformers import TrainerCallback

    class Hooks(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            # prepare() reset the forced state: FSDP again, so that the Trainer's no_sync for all but the last
            # micro-batch calls set_requires_gradient_sync(False), as it does on GPUs
            force_fsdp(AcceleratorState())
            self.model, self.opt = model, optimizer.optimizer
            self.before = hook_state(model, self.opt)

    return Hooks()


def make_trainer(callbacks, out_dir, slow_ms=0.0, fsdp_config=None, width=512, seq=SEQ, items=64, eval_items=8,
                 vl=False, model_gc=False, **args):
    """A Hugging Face Trainer of a Llama (``width``) on 2 micro-batches of 2 sequences of ``seq`` tokens per step,
    8 steps, evaluating every 3, sharded by accelerate's FSDP2 plugin as the Trainer makes it from ``fsdp_config``
    (``TrainingArguments(fsdp=True, fsdp_config=...)``; accelerate enables FSDP on GPUs only, so the plugin and
    the state are forced here, as in run_accelerate); ``items``: training sequences, ``eval_items`` evaluation
    ones; ``args``: more TrainingArguments. ``vl``: a Qwen2.5-VL on images and text (clients.qwen_vl), the plugin's
    policy over its _no_split_modules (both block classes); ``model_gc``: the model's own checkpointing switched on
    by the user's code before the Trainer is built (its training argument off)."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    import clients

    torch.manual_seed(0)
    # (wide enough that the model's step outweighs the Trainer's own per-step work outside the model, 10-13 ms
    # here: 6% of the step at width 512, 15-23% at width 64, where jitter.data_wait fires from 15%)
    model = clients.qwen_vl() if vl else LlamaForCausalLM(llama_config(width, max_position_embeddings=max(2 * SEQ,
                                                                                                        seq)))
    if model_gc:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    kw = dict(output_dir=str(out_dir), per_device_train_batch_size=2, per_device_eval_batch_size=2,
              gradient_accumulation_steps=2, max_steps=8, eval_strategy="steps", eval_steps=3, logging_steps=1,
              save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True, seed=0)
    fsdp_config = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": model._no_split_modules if vl else [
        "LlamaDecoderLayer"], "reshard_after_forward": True, **(fsdp_config or {})}
    targs = TrainingArguments(**{**kw, **args}, fsdp=True, fsdp_config=fsdp_config)
    data = (dict(train_dataset=_VLItems(items, 0), eval_dataset=_VLItems(eval_items, 10_000),
                 data_collator=clients.qwen_vl_collate) if vl else
            dict(train_dataset=_Tokens(items, 0, slow_ms, seq), eval_dataset=_Tokens(eval_items, 10_000, 0.0, seq)))
    tr = Trainer(model=model, args=targs, callbacks=callbacks, **data)
    trainer_fsdp(tr)
    st = tr.accelerator.state
    if st.mixed_precision != "no":  # as AcceleratorState does on a GPU (bf16=True: reduce_dtype bfloat16)
        st.fsdp_plugin.set_mixed_precision(st.mixed_precision)
    return tr


def trainer_fsdp(tr) -> None:
    """A built Trainer's accelerator on its FSDP path, as on a GPU: the FSDP2 plugin the Trainer makes from its
    arguments (trainer.py: from args.fsdp_plugin_args), the state forced to FSDP (force_fsdp) and the Trainer's own
    flag on."""
    from accelerate import FullyShardedDataParallelPlugin

    tr.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**tr.args.fsdp_plugin_args)
    force_fsdp(tr.accelerator.state)
    tr.is_fsdp_enabled = True


def run_trainer(out: Path) -> dict:
    """A Hugging Face ``Trainer`` (accelerate's FSDP2 plugin, forced to FSDP as in run_accelerate) training a
    Llama for 8 optimizer steps of 2 micro-batches, evaluating after steps 3 and 6: without the doctor, then with
    ``fsdp_doctor.DoctorCallback``; then a second ``train()`` into the same run directory (refused: one log line,
    training goes on) and a callback with a misspelt option (refused before training); then trainer_saves."""
    rank, world = torchrun_env()

    def losses(tr):
        return [h["loss"] for h in tr.state.log_history if "loss" in h]

    base_hooks = trainer_hooks()
    base = make_trainer([base_hooks], out / "base")
    base.train()
    def changed(h):  # what changed in the hook state over train(): the Trainer's own changes, by module and kind
        after = hook_state(h.model, h.opt)
        return {k: {d: len(v) for d, v in after[k].items()} if isinstance(after[k], dict) else after[k]
                for k in diff(h.before, after)}

    base_left = changed(base_hooks)
    # (no profiler window: in 8 steps evaluating every 3, the window and its two retakes (each met an evaluation)
    # and the first three steps, measured in full, would leave the statistics only full steps, whose time outside
    # the model holds the memory high-water's cost between micro-batches)
    hooks, doctor = trainer_hooks(), fsdp_doctor.DoctorCallback(out_dir=str(out / "trainer"), profile=False)
    tr = make_trainer([hooks, doctor], out / "hf")
    tr.train()
    left = changed(hooks)
    first_losses = losses(tr)
    def params(model):  # (the Trainer leaves the root's norm and lm_head unsharded after train(), with or without)
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]

    identical = losses(tr) == losses(base) and same_tensors(params(hooks.model), params(base_hooks.model))
    # the report of that run (every rank's records complete: read after both have trained), its fixes as Trainer
    # callbacks; prefetch.sync_unshard's (gloo's all-gathers block the host) pasted as printed, with the Trainer
    dist.barrier()
    report = fsdp_doctor.build_report(fsdp_doctor.load_run(out / "trainer"))
    fixes = {f.code: f.recommendation for f in report.findings if f.recommendation.code}
    fixed = None
    if "prefetch.sync_unshard" in fixes:
        tr3 = make_trainer([trainer_hooks(), fsdp_doctor.DoctorCallback(out_dir=str(out / "fixed"))], out / "hf3")
        exec(compile(fixes["prefetch.sync_unshard"].code, "<prefetch.sync_unshard fix>", "exec"), {"trainer": tr3})
        tr3.train()
        dist.barrier()
        after = fsdp_doctor.build_report(fsdp_doctor.load_run(out / "fixed"))
        fixed = next(s.status for s in after.rules if s.code == "prefetch.sync_unshard")
    # a slow data pipeline (25 ms an item, 4 items a step): jitter.data_wait, whose fix under the Trainer sets its
    # DataLoader arguments on trainer.args; pasted as printed into a new Trainer, the rule is quiet in that run
    def data_wait(name, fix=None):
        tr_ = make_trainer([trainer_hooks(), fsdp_doctor.DoctorCallback(out_dir=str(out / name), profile=False)],
                           out / f"hf_{name}", slow_ms=25.0)
        if fix is not None:
            exec(compile(fix, "<jitter.data_wait fix>", "exec"), {"trainer": tr_})
        tr_.train()
        dist.barrier()
        rep = fsdp_doctor.build_report(fsdp_doctor.load_run(out / name))
        return (next((f for f in rep.findings if f.code == "jitter.data_wait"), None),
                next(s.status for s in rep.rules if s.code == "jitter.data_wait"))

    wait, _ = data_wait("slow")
    wait_after = data_wait("slow_fixed", wait.recommendation.code)[1] if wait and wait.recommendation.code else None
    rd = fsdp_doctor.load_run(out / "trainer").ranks[rank]
    again = make_trainer([trainer_hooks(), fsdp_doctor.DoctorCallback(out_dir=str(out / "trainer"))], out / "hf2")
    again.train()  # a second run into the same run directory: the first moved aside to previous/run-ID, recorded
    try:
        fsdp_doctor.DoctorCallback(out_dir=str(out / "x"), memroy=False)
        misspelt = None
    except TypeError as e:
        misspelt = str(e)
    return {"identical": identical, "left": left, "base_left": base_left, "losses": first_losses,
            "steps": [s.step for s in rd.steps], "micro_batches": [s.micro_batches for s in rd.steps],
            "no_grad": {s.step: [s.no_grad_forwards, s.no_grad_ms] for s in rd.steps if s.no_grad_forwards},
            "between": {s.step: [s.between_ms, s.outside_ms, s.wall_ms] for s in rd.steps},
            "unit_calls": [[u.fwd_calls for u in s.units] for s in rd.steps], "optimizer": rd.config.optimizer,
            "second_losses": losses(again), "fix_places": {c: r.where for c, r in fixes.items()},
            "sync_unshard_fix": fixes["prefetch.sync_unshard"].code if "prefetch.sync_unshard" in fixes else None,
            "sync_unshard_after_fix": fixed, "misspelt": misspelt, "errors": len(rd.errors),
            "data_wait": None if wait is None else {"share": wait.evidence["outside_share_pct"],
                                                    "where": wait.recommendation.where,
                                                    "code": wait.recommendation.code, "text": wait.recommendation.text},
            "data_wait_after_fix": wait_after, "outside_ms_p50": statistics.median(s.outside_ms for s in rd.steps),
            **trainer_saves(out, rank)}


def run_trainer_compiled(out: Path) -> dict:
    """A Hugging Face ``Trainer`` with ``torch_compile=True`` (Dynamo's eager backend: no C++ toolchain) and
    ``gradient_checkpointing=True`` over accelerate's FSDP2 plugin, which applies fully_shard to the compiled
    wrapper (an FSDPOptimizedModule): without the doctor, then with ``fsdp_doctor.DoctorCallback``; the losses of
    both, and what the run recorded."""
    rank, world = torchrun_env()

    def train(callbacks, name):
        tr = make_trainer([trainer_hooks(), *callbacks], out / name, torch_compile=True,
                          torch_compile_backend="eager", gradient_checkpointing=True)
        tr.train()
        return tr, [h["loss"] for h in tr.state.log_history if "loss" in h]

    _, base = train([], "hf_base")
    torch._dynamo.reset()  # (its cache holds the first model: "another model alive" in the second run's report)
    gc.collect()
    tr, watched = train([fsdp_doctor.DoctorCallback(out_dir=str(out / "run"), profile=False)], "hf_run")
    dist.barrier()
    run = fsdp_doctor.load_run(out / "run")
    rd = run.ranks[rank]
    report = fsdp_doctor.build_report(run)
    return {"wrapper": type(tr.model_wrapped).__name__, "identical": base == watched and len(base) == 8,
            "has_forward": rd.config.model_has_forward, "notes": report.run.notes, "errors": len(rd.errors),
            "steps": [s.step for s in rd.steps], "micro_batches": [s.micro_batches for s in rd.steps],
            "forward_ms": [s.forward_ms for s in rd.steps], "backward_ms": [s.backward_ms for s in rd.steps],
            "unit_fwd_ms": [[u.fwd_ms for u in s.units] for s in rd.steps],
            "units": [u.name for u in rd.config.units], "checkpoint": [u.checkpoint for u in rd.config.units],
            "findings": sorted(f.code for f in report.findings)}


def trainer_saves(out: Path, rank: int) -> dict:
    """A Trainer saving a checkpoint every 2 of its 8 steps (save_strategy "steps", accelerate's plugin's default
    FULL_STATE_DICT: the model and optimizer gathered and written whole), watched: each save timed apart from the
    time outside the model; checkpoint.blocking's fix (how often it saves, on trainer.args) pasted as printed into
    a new Trainer, which then saves less often and leaves the rule quiet."""
    def saving(name, fix=None):
        tr_ = make_trainer([trainer_hooks(), fsdp_doctor.DoctorCallback(out_dir=str(out / name), profile=False)],
                           out / f"hf_{name}", save_strategy="steps", save_steps=2)
        if fix is not None:
            exec(compile(fix, "<checkpoint.blocking fix>", "exec"), {"trainer": tr_})
        tr_.train()
        dist.barrier()
        run = fsdp_doctor.load_run(out / name)
        rep = fsdp_doctor.build_report(run)
        f = next((f for f in rep.findings if f.code == "checkpoint.blocking"), None)
        return {"saves": {s.step: [s.checkpoints, s.checkpoint_ms, s.outside_ms] for s in run.ranks[rank].steps
                          if s.checkpoints},
                "status": next(s.status for s in rep.rules if s.code == "checkpoint.blocking"),
                "checkpoints": {r: msgspec.to_builtins(c) for r, c in rep.steps.checkpoints.items()},
                "outliers": [[o.rank, o.step, o.cause] for o in rep.steps.outliers],
                "findings": sorted(f.code for f in rep.findings if f.severity != "info"),
                "save_dirs": sorted(p.name for p in (out / f"hf_{name}").glob("checkpoint-*")),
                "wall_ms": round(sum(s.wall_ms for s in run.ranks[rank].steps), 1),
                "state_dict_type": run.ranks[rank].config.plugin_state_dict_type,
                "finding": None if f is None else {"severity": f.severity, "evidence": f.evidence,
                                                   "where": f.recommendation.where, "code": f.recommendation.code,
                                                   "text": f.recommendation.text}}

    before = saving("saves")
    fix = before["finding"] and before["finding"]["code"]
    return {"saves": before, "saves_fixed": saving("saves_fixed", fix) if fix else None}


def held_objects(n: int, cycles: int = 0):
    """A Trainer callback that keeps ``n`` small objects for the whole run from its start (a dataset's index, a
    tokenizer's cache) and ``n // 4`` more each step for 3 steps (its records): no reference cycle, but the full
    collections their survivors set off traverse them all (the scenario matrix's gc_heap knob); and drops
    ``cycles`` two-object reference cycles each step (its gc_garbage knob), which only the collector frees."""
    from transformers import TrainerCallback

    from fsdp_doctor.workloads.train import hold_objects, make_garbage

    class Held(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            hold_objects(n)

        def on_step_begin(self, args, state, control, **kwargs):
            hold_objects(n)
            make_garbage(cycles)

    return Held()


#: the Trainer gc case's reference cycles a step (TRAINER_GC_CYCLES, 2 objects each) and its optimizer steps: the
#: fix's period is the steps in which the cycles left to a collection stay under a million objects (14-15 here:
#: 140k objects a step would be 7, under the rule's 10, and a fix of words), so that its rerun reaches a collection
TRAINER_GC_CYCLES, TRAINER_GC_STEPS = 35_000, 18


def run_trainer_gc(out: Path) -> dict:
    """A Trainer whose callback keeps 500k objects for the run and 125k a step for 3 steps, and drops 35k reference
    cycles a step (held_objects): the collector's full collections traverse them inside the steps (jitter.gc). Its
    fix, pasted as printed with the Trainer built, before train(): each run's findings, the GC's share of the step,
    its collections (those with the collector off apart, by step), and whether the collector is on after train()
    (the fix turns it off for the run's steps)."""
    from fsdp_doctor.workloads.train import release_objects

    rank, world = torchrun_env()
    res = {}
    for name in ("gc", "gc_fixed"):
        fix = res["gc"]["findings"].get("jitter.gc") if name == "gc_fixed" else None
        if name == "gc_fixed" and fix is None:
            break
        tr = make_trainer([trainer_hooks(), fsdp_doctor.DoctorCallback(out_dir=str(out / name), profile=False),
                           held_objects(500_000, TRAINER_GC_CYCLES)], out / f"hf_{name}",
                          max_steps=TRAINER_GC_STEPS, eval_strategy="no")
        if fix is not None:
            exec(compile(fix["code"], "<jitter.gc fix>", "exec"), {"trainer": tr})
        try:
            tr.train()
            res[name] = {"collector_on_after": gc.isenabled()}
        finally:
            gc.enable()
            release_objects()
        dist.barrier()
        res[name].update(_outcome(out / name, rank), losses=[h["loss"] for h in tr.state.log_history if "loss" in h])
        st = res[name]["step_stats"]
        res[name].update(gc_pct=round(100 * st["gc_ms_total"] / st["wall_ms_total"], 2),
                         gc_collections=st["gc_count_total"], steps=st["count"], mean_ms=st["mean_ms"],
                         gc_ms=st["gc_ms_total"], gc_by_hand_ms=st.get("gc_disabled_ms_total", 0.0))
    return res


def report_findings(rep) -> dict:
    """A report's findings (severity, where the fix goes, the fix, its text, inputs and prediction) and the quiet
    rules' reasons."""
    return {"findings": {f.code: {"severity": f.severity, "where": f.recommendation.where,
                                  "code": f.recommendation.code, "text": f.recommendation.text,
                                  "inputs": f.recommendation.inputs,
                                  "predicted": msgspec.to_builtins(f.predicted) if f.predicted else None}
                         for f in rep.findings},
            "quiet": {s.code: s.reason for s in rep.rules if s.status == "quiet"}}


def _outcome(path: Path, rank: int) -> dict:
    """A fix case's run read back: its findings (severity, where the fix goes, the fix, its text and prediction),
    the quiet rules' reasons, the peak, each unit's checkpointing and reduction dtypes, the rank's step statistics
    and the steps it collected in with the collector off."""
    run = fsdp_doctor.load_run(path)
    rep = fsdp_doctor.build_report(run)
    return {**report_findings(rep), "peak": rep.memory.peak_bytes, "sharded_by": run.ranks[rank].config.sharded_by,
            "step_stats": msgspec.to_builtins(rep.steps.per_rank.get(str(rank))),
            # [step, collections] where the rank collected with the collector off (a Trainer callback's collection
            # at the end of global_step N, after the doctor's own callback ended that step, is counted in the next
            # one, numbered N from 0)
            "by_hand": [[s.step, s.gc_disabled_count] for s in run.ranks[rank].steps if s.gc_disabled_count],
            "units": [[u.name, u.checkpoint, u.checkpoint_wrappers, u.param_dtype, u.reduce_dtype]
                      for u in run.ranks[rank].config.units],
            "selective": [u.name for u in run.ranks[rank].config.units if u.checkpoint_selective],
            # (compare's job setting: a chunked loss's chunks)
            "loss_chunks": rep.run.loss_chunks or None}


def run_trainer_fixes(out: Path) -> dict:
    """Fixes whose lever is the Trainer's own setting, diagnosed and applied as its user would (pasted as printed,
    with the Trainer built, before train()): checkpointing on under an 8 GiB budget, by Hugging Face's training
    argument, by the model's own switch (the user's code) and by FSDP's own (fsdp_config), each rerun with its
    ac.unneeded fix; bf16=True, whose FSDP2 policy
    reduces in bfloat16, rerun with numerics.reduce_dtype's fix; a Llama whose activations dominate (width 128,
    256 tokens a sequence) under a budget 5% above its peak, rerun with ac.recommended's fix; no wrap policy
    (the decoder layers left in the root), and a Qwen2.5-VL's vision merger the policy leaves there, each rerun with
    wrap.params_in_root's fix."""
    rank, world = torchrun_env()
    res = {}

    def run(name, fix=None, capacity=8 << 30, **kw):
        tr = make_trainer([trainer_hooks(), fsdp_doctor.DoctorCallback(out_dir=str(out / name), profile=False,
                                                                       capacity_bytes=capacity)],
                          out / f"hf_{name}", **{"max_steps": 6, "eval_strategy": "no", **kw})
        if fix:
            exec(compile(fix, f"<{name} fix>", "exec"), {"trainer": tr})
        tr.train()
        dist.barrier()
        res[name] = {**_outcome(out / name, rank), "losses": [h["loss"] for h in tr.state.log_history if "loss" in h],
                     "grad_norms": [h["grad_norm"] for h in tr.state.log_history if "grad_norm" in h],
                     "eval_losses": [h["eval_loss"] for h in tr.state.log_history if "eval_loss" in h]}
        return res[name]["findings"]

    return _each_fixed(run, res, [("hf_ample", "ac.unneeded", {"activation_checkpointing": True}),
                                  # the model's own switch, turned on by the user's code
                                  ("model_ample", "ac.unneeded", {"model_gc": True}),
                                  # activations that matter (as "tight"), the checkpointed peak at 70% of the
                                  # budget: one of the two layers fits without
                                  ("hf_some", "ac.fewer_units", {"activation_checkpointing": True, "width": 128,
                                                                 "seq": 256, "capacity_share": 0.70}),
                                  ("fsdp_ample", "ac.unneeded", {"fsdp_config": {"activation_checkpointing": True}}),
                                  # its 2 micro-batches a step, each unit gathered again in the second; 60
                                  # sequences, 15 micro-batches a rank an epoch: its 8th step has one, and the
                                  # clipping that follows it must see every gradient
                                  ("regather", "accum.regather", {"items": 60, "max_steps": 9,
                                                                  "max_grad_norm": 0.3}),
                                  # accelerate's policy for bf16=True reduces in bfloat16
                                  ("bf16", "numerics.reduce_dtype", {"bf16": True}),
                                  # the Trainer's own evaluations (every 2 steps, 12 batches a rank), each forward
                                  # gathering every unit again
                                  ("evaluate", "eval.regather", {"eval_strategy": "steps", "eval_steps": 2,
                                                                 "eval_items": 48}),
                                  ("tight", "ac.recommended", {"width": 128, "seq": 256}),
                                  # no wrap policy: the decoder layers stay in the root
                                  ("nowrap", "wrap.params_in_root", {"fsdp_config": {
                                      "auto_wrap_policy": "NO_WRAP", "transformer_layer_cls_to_wrap": None}}),
                                  # a Qwen2.5-VL: its vision merger, between the block stacks, left in the root
                                  ("vl_merger", "wrap.params_in_root", {"vl": True})])


#: a fix case's rerun peaks at its prediction within this share of it (tests/test_recorder_cases.py)
PEAK_WITHIN = 0.10


def fixed_pair(res: dict, name: str, code: str, where: str, sharded_by: str,
               within: float = PEAK_WITHIN) -> tuple[dict, dict, dict]:
    """(the run ``name``, its rerun with ``code``'s fix applied, the finding), as _each_fixed left them in ``res``:
    the fix was printed for ``where``, both runs were sharded by ``sharded_by``, the rerun does not raise the
    finding again, its peak is the predicted one within ``within``, and it has no new warning (one the run did not
    have at any severity, as the scenario matrix counts them)."""
    from scenario_matrix import HEADROOM

    before, after = res[name], res[f"{name}_fixed"]
    f = before["findings"].get(code)
    assert f is not None and f["where"] == where, (name, before["findings"].keys())
    assert before["sharded_by"] == after["sharded_by"] == sharded_by, before["sharded_by"]
    assert code not in after["findings"], after["findings"].keys()
    predicted = f["predicted"]["peak_bytes_after"]
    if f["predicted"].get("at_most") or f["predicted"].get("peak_at_most"):  # a ceiling: at or under it
        assert after["peak"] - predicted <= within * predicted, (name, after["peak"], predicted)
    else:
        assert abs(after["peak"] - predicted) <= within * predicted, (name, after["peak"], predicted)
    # (a warning the run had at any severity is not the fix's: without the recompute, the same all-gather waits
    # are a larger share of a shorter step, and reshard.zero2_affordable's note can grow to a warning; nor is
    # memory to spare offered, as the scenario matrix counts it: blocks resharded after the wrap fix leave room
    # for ZeRO-2)
    new = {c for c, g in after["findings"].items() if g["severity"] != "info"} - HEADROOM
    assert new <= set(before["findings"]), (name, set(before["findings"]), new)
    return before, after, f


def _each_fixed(run, res: dict, cases: list) -> dict:
    """Runs each case (its name, the finding it plants, ``run``'s options), then, where the finding came, again
    with its fix pasted as printed (``NAME_fixed``). "tight" runs under a budget 5% above the peak of the same
    options' run, "measure" ("tight_X": "measure_X"), a case with ``capacity_share`` in its options under the peak of
    such a run ("measure_NAME") over that share; the others under 8 GiB. ``res``: what ``run`` filled in, by name.

    A pair whose fixed run's peak misses the prediction by more than PEAK_WITHIN runs again once (``NAME_again``, its
    results then stand for the pair; ``NAME_missed`` keeps the first peak and prediction), as the scenario matrix
    does: gloo frees a finished all-gather's buffers only when its thread is next scheduled, so one such buffer
    can be counted in a peak (tests/scenario_matrix.py). Every rank reads the same report: they agree."""
    for name, code, kw in cases:
        share = kw.pop("capacity_share", 0.95 if name.startswith("tight") else None)
        if share:  # ("tight_X" measures as "measure_X", another case NAME as "measure_NAME")
            measure = "measure" + name[len("tight"):] if name.startswith("tight") else f"measure_{name}"
            run(measure, **kw)
            kw = {**kw, "capacity": int(res[measure]["peak"] / share)}
        for attempt in (name, f"{name}_again"):
            found = run(attempt, **kw)
            if code not in found:
                break
            run(f"{attempt}_fixed", found[code]["code"], **kw)
            p = found[code]["predicted"]
            want, got = p["peak_bytes_after"], res[f"{attempt}_fixed"]["peak"]
            off = got - want if p.get("at_most") or p.get("peak_at_most") else abs(got - want)  # (a ceiling)
            if attempt != name:
                res[name], res[f"{name}_fixed"] = res[attempt], res[f"{attempt}_fixed"]
            elif want and off > PEAK_WITHIN * want:
                res[f"{name}_missed"] = {"peak": got, "predicted": want}
                continue
            break
    return res


def run_accelerate_fixes(out: Path) -> dict:
    """Fixes whose lever is accelerate's FSDP2 plugin, in a loop of the user's own around accelerator.prepare
    (forced to FSDP as in run_accelerate), applied as its user would: pasted as printed with the Accelerator
    built, before prepare(). The plugin's checkpointing under an 8 GiB budget, rerun with ac.unneeded's fix;
    mixed_precision="bf16" (its policy reduces in bfloat16), rerun with numerics.reduce_dtype's fix; a Llama whose
    activations dominate (width 128, 256 tokens a sequence) under a budget 5% above its peak, rerun with
    ac.recommended's fix; no wrap policy (the decoder layers left in the root; and a diffusers Flux's two block
    lists), rerun with wrap.params_in_root's fix; AdamW's foreach step at a peak 5% under its budget, rerun with
    optim.foreach_temporaries' fix, which goes on the optimizer prepare() returned (accelerate's wrapper). Each
    run: 5 steps of one micro-batch; the report's findings as in run_trainer_fixes."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from transformers import LlamaForCausalLM

    import clients

    rank, world = torchrun_env()
    res = {}

    def run(name, fix=None, capacity=8 << 30, mixed="no", ac=False, width=512, seq=SEQ,
            wrap="transformer_based_wrap", foreach=None, layers=2, flux=False, vl=False, load_bf16=False):
        AcceleratorState._reset_state()  # a new Accelerator per run (the process group stays)
        acc = Accelerator(cpu=True, mixed_precision=mixed)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy=wrap, reshard_after_forward=True, activation_checkpointing=ac,
            # (a Qwen2.5-VL: the policy over its _no_split_modules, both block classes)
            transformer_cls_names_to_wrap=(["LlamaDecoderLayer"] if wrap == "transformer_based_wrap" and not vl
                                           else None))
        if mixed != "no":  # as AcceleratorState does on a GPU (bf16: reduce_dtype bfloat16)
            plugin.set_mixed_precision(mixed)
        force_fsdp(acc.state, plugin)
        torch.manual_seed(0)
        model = clients.flux() if flux else clients.qwen_vl(load_bf16) if vl else LlamaForCausalLM(llama_config(
            width, max_position_embeddings=max(2 * SEQ, seq), num_hidden_layers=layers))
        on_opt = fix is not None and "optimizer.param_groups" in fix  # (where "optimizer": after prepare)
        if fix and not on_opt:  # where it says: with the Accelerator built, before accelerator.prepare(model)
            exec(compile(fix, f"<{name} fix>", "exec"), {"accelerator": acc, "model": model})
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach))
        if on_opt:  # on the optimizer the user holds: accelerate's AcceleratedOptimizer
            exec(compile(fix, f"<{name} fix>", "exec"), {"optimizer": opt, "torch": torch})
        data = _Tokens(STEPS * 2, 0, seq=seq)
        with fsdp_doctor.watch(model, opt, out_dir=str(out / name), profile=False, capacity_bytes=capacity) as doc:
            for step in range(STEPS):
                if flux:  # (diffusers' Flux, trained by flow matching on image latents: tests/clients.py)
                    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
                    acc.backward(clients.flux_loss(model, g, 2, None))
                elif vl:  # (transformers' Qwen2.5-VL: an image and text per sample)
                    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
                    acc.backward(clients.qwen_vl_loss(model, g, 2, None))
                else:
                    tok = torch.stack([data[2 * step + i]["input_ids"] for i in range(2)])
                    acc.backward(model(input_ids=tok, labels=tok).loss)
                opt.step()
                opt.zero_grad()
                doc.step()
        dist.barrier()
        res[name] = _outcome(out / name, rank)
        return res[name]["findings"]

    return _each_fixed(run, res, [("fsdp_ample", "ac.unneeded", {"ac": True}),
                                  ("bf16", "numerics.reduce_dtype", {"mixed": "bf16"}),
                                  ("tight", "ac.recommended", {"width": 128, "seq": 256}),
                                  # no wrap policy: the decoder layers stay in the root
                                  ("nowrap", "wrap.params_in_root", {"wrap": "no_wrap"}),
                                  # diffusers' Flux, no wrap policy: both block lists in the root
                                  ("flux_nowrap", "wrap.params_in_root", {"wrap": "no_wrap", "flux": True}),
                                  # a Qwen2.5-VL, the policy over both block classes: the vision merger (between the
                                  # stacks) left in the root
                                  ("vl_merger", "wrap.params_in_root", {"vl": True}),
                                  # the same loaded in bfloat16 under mixed precision: prepare() upcasts it to
                                  # float32, but not the merger the fix shards first
                                  ("vl_merger_bf16", "wrap.params_in_root", {"vl": True, "mixed": "bf16",
                                                                             "load_bf16": True}),
                                  # AdamW foreach (CUDA's default; asked for on the CPU), 8 layers: the step is the
                                  # peak (with 2, a layer gathered in backward and its gradients are more)
                                  ("tight_foreach", "optim.foreach_temporaries",
                                   {"foreach": True, "layers": 8, "width": 256})])


#: torch's tensor parallelism on an HF Llama's decoder layers (its module names): attention heads and the MLP's hidden
#: units split over the "tp" dim, the outputs all-reduced
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


def force_fsdp(state, plugin=None) -> None:
    """accelerate's state forced to its FSDP path, as it is on a GPU (where AcceleratorState sets both): on the
    CPU it is MULTI_CPU. Set on PartialState's shared state too: each AcceleratorState() copies PartialState's
    back, and accelerator.accumulate(model) read MULTI_CPU again and left gradient sync on in every micro-batch
    (its no_sync looks for DDP's no_sync there; an FSDP2 model has none)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if plugin is not None:
        state.fsdp_plugin = plugin
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP


#: the accelerate accumulation case's micro-batches per optimizer step, and its optimizer steps
ACCUM_MICRO, ACCUM_STEPS = 4, 6


def run_accelerate_accum(out: Path) -> dict:
    """Gradient accumulation as an accelerate user runs it: each of ACCUM_MICRO micro-batches a step inside
    ``with accelerator.accumulate(model):`` (accelerator.backward, optimizer.step() and zero_grad() in each, which
    accelerate skips but on the last), accelerate's FSDP2 plugin sharding an HF Llama (forced to FSDP:
    force_fsdp), doctor.step() per micro-batch, a profiler window over step 3. ``default``: the
    GradientAccumulationPlugin's defaults, gradient sync on the last micro-batch alone; ``each``: its
    sync_each_batch=True, rerun with accum.sync_every_micro_batch's fix pasted as printed (``each_fixed``, with the
    Accelerator built, before prepare()). Each run's report as in run_trainer_fixes, with each rank's
    AccelerateAccumulation record and backward counts."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import GradientAccumulationPlugin
    from transformers import LlamaForCausalLM

    rank, world = torchrun_env()
    res = {}

    def run(name, fix=None, sync_each_batch=False):
        AcceleratorState._reset_state()  # a new Accelerator per run (the process group stays)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=ACCUM_MICRO, sync_each_batch=sync_each_batch))
        force_fsdp(acc.state, FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"]))
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(256))
        if fix:  # where it says: with the Accelerator built, before accelerator.prepare(model)
            exec(compile(fix, f"<{name} fix>", "exec"), {"accelerator": acc, "model": model})
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        data = _Tokens(ACCUM_STEPS * ACCUM_MICRO * BATCH, 0)
        with fsdp_doctor.watch(model, opt, out_dir=str(out / name), capacity_bytes=8 << 30,
                               profile=ProfileSchedule(first=3, warmup=1, active=1)) as doc:
            for i in range(ACCUM_STEPS * ACCUM_MICRO):
                with acc.accumulate(model):
                    tok = torch.stack([data[BATCH * i + j]["input_ids"] for j in range(BATCH)])
                    acc.backward(model(input_ids=tok, labels=tok).loss)
                    opt.step()
                    opt.zero_grad()
                doc.step()
        dist.barrier()
        run_ = fsdp_doctor.load_run(out / name)
        rd = run_.ranks[rank]
        res[name] = {**_outcome(out / name, rank), "accelerate": msgspec.to_builtins(rd.config.accelerate),
                     "backwards": [[s.backwards, s.synced_backwards] for s in rd.steps],
                     # each unit's reduce-scatters per optimizer step in the trace (this rank's)
                     "reduce_scatters": sorted([r.unit, r.count_per_step] for r in fsdp_doctor.build_report(
                         run_).overlap.per_unit if r.rank == rank and r.collective == "reduce_scatter")}
        return res[name]["findings"]

    run("default")
    return _each_fixed(run, res, [("each", "accum.sync_every_micro_batch", {"sync_each_batch": True})])


def run_tp_fixes(out: Path) -> dict:
    """Tensor parallelism beside FSDP in a user's own code (4 ranks: a ("dp", "tp") mesh of 2 x 2): an HF Llama whose
    decoder layers torch's parallelize_module splits over mesh["tp"], then fully_shard(model, mesh=mesh["dp"]) alone
    (the whole model one unit), watched; the same run without the doctor (its losses); wrap.too_coarse's fix pasted
    in place of that fully_shard call, reading the user's FSDP mesh (the fix's input "dp_mesh": mesh["dp"]); each layer
    sharded on mesh["dp"] and the root forgotten, wrap.root_not_sharded's fix run after those calls. On CUDA
    (4 NCCL ranks: tests/test_gpu.py) the watched runs take a profiler window (steps 3-4): where the trace puts the
    collectives no FSDP unit issued, by phase."""
    from clients import scenario_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    dev = scenario_device()
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in TP_PLAN.items()}
    profile = ProfileSchedule(first=3, active=2) if dev.type == "cuda" else False
    rank, res = dist.get_rank(), {}

    def run(name, fix=None, capacity=8 << 30, watched=True, blocks=False):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(width=128, attn_implementation="sdpa")).to(dev)
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        if blocks:  # each layer on mesh["dp"], the root forgotten; a fix goes after these calls
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            if fix:
                exec(compile(fix, "<wrap.root_not_sharded fix>", "exec"), {"model": model})
        elif fix:  # in place of the user's fully_shard calls, with their FSDP mesh
            # (the user's own names: `mesh` the whole 2-D mesh, as in torch's examples, and dp_mesh its FSDP part)
            exec(compile(fix, "<wrap.too_coarse fix>", "exec"), {"model": model, "mesh": mesh, "dp_mesh": mesh["dp"]})
        else:
            fully_shard(model, mesh=mesh["dp"])
        for m in model.modules():  # gloo's tuned setting (its all-gathers block the host otherwise), as the scenarios
            if isinstance(m, FSDPModule):
                m._set_unshard_async_op(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ctx = fsdp_doctor.watch(model, opt, out_dir=str(out / name), capacity_bytes=capacity,
                                profile=profile) if watched else None
        doc = ctx.__enter__() if ctx else None
        losses = []
        for step in range(6):  # the same batch on the two ranks of a tensor-parallel group
            g = torch.Generator().manual_seed(1000 * step + mesh["dp"].get_local_rank())
            tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(dev)
            loss = F.cross_entropy(model(input_ids=tok[:, :-1]).logits.float().flatten(0, 1), tok[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if doc is not None:
                doc.step()
            losses.append(loss.item())
        if ctx is not None:
            ctx.__exit__(None, None, None)
            dist.barrier()
            rec = fsdp_doctor.load_run(out / name)
            rows = fsdp_doctor.build_report(rec).overlap.per_unit if profile else []
            res[name] = {**_outcome(out / name, rank), "losses": losses, "mesh": rec.ranks[rank].config.mesh,
                         "other": sorted({r.phase or "loop" for r in rows if r.unit == "(other)" and r.rank == rank})}
            return res[name]["findings"]
        res[name] = {"losses": losses}
        return {}

    run("unwatched", watched=False)
    # the root forgotten leaves the embeddings and lm_head plain tensors beside the layers' DTensors: on CUDA the
    # user's own AdamW (foreach there by default) raises at its first step ("got mixed torch.Tensor and DTensor"),
    # so that run exists on the CPU alone, where AdamW steps one tensor at a time
    return _each_fixed(run, res, [("coarse", "wrap.too_coarse", {})]
                       + ([("no_root", "wrap.root_not_sharded", {"blocks": True})] if dev.type == "cpu" else []))


def run_hf_native_fixes(out: Path) -> dict:
    """transformers' own FSDP2 and tensor parallelism (4 ranks): an HF Llama saved here, loaded with
    from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)), which shards it by its
    fsdp_plan (each layer a unit, the embeddings, [norm, lm_head] kept gathered, the root) on its own mesh;
    watched under an 8 GiB budget (gloo's synchronous unshard: the backward's all-gathers are waits a ZeRO-2 unit
    saves), then rerun with reshard.zero2_affordable's fix run after from_pretrained, as printed."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    rank, world = torchrun_env()
    path = out / "llama"
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(width=128)).save_pretrained(path)
    dist.barrier()
    res = {}

    def run(name, fix=None, capacity=8 << 30):
        model = LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))
        if fix:  # after from_pretrained returns the sharded model
            exec(compile(fix, "<reshard.zero2_affordable fix>", "exec"), {"model": model})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with fsdp_doctor.watch(model, opt, out_dir=str(out / name), capacity_bytes=capacity,
                               profile=ProfileSchedule(first=3, active=2)) as doc:
            for step in range(6):  # the same batch on the two ranks of a tensor-parallel group
                g = torch.Generator().manual_seed(1000 * step + rank // 2)
                tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
                model(input_ids=tok, labels=tok).loss.backward()
                opt.step()
                opt.zero_grad()
                doc.step()
        dist.barrier()
        cfg = fsdp_doctor.load_run(out / name).ranks[rank].config
        res[name] = {**_outcome(out / name, rank), "version": cfg.sharder_version, "mesh": cfg.mesh}
        return res[name]["findings"]

    return _each_fixed(run, res, [("zero2", "reshard.zero2_affordable", {})])


def _implied_group(row) -> Optional[int]:
    """The group size a per-unit row's bus bandwidth was computed for: (n - 1) / n of an all-gather's or a
    reduce-scatter's bytes, 2 (n - 1) / n of an all-reduce's, per call time."""
    if row.busbw_gbps is None or not row.bytes_per_call or not row.comm_us:
        return None
    f = row.busbw_gbps * row.comm_us * 1e3 / (row.bytes_per_call * row.count)
    f = f / 2 if row.collective == "all_reduce" else f
    return round(1 / (1 - f)) if f < 1 else None


def run_hsdp_fixes(out: Path) -> dict:
    """HSDP in a user's own code (4 ranks: a ("replicate", "shard") mesh of 2 x 2): an HF Llama sharded whole on it
    (fully_shard(model, mesh=mesh): one unit), watched; wrap.too_coarse's fix pasted in place of that call with the
    user's mesh (the fix's input "mesh"), where a 1-D mesh over all 4 ranks (the fix once defined one) would have
    turned HSDP into FSDP over the world: each rank's shard half the size, the replicas' all-reduce gone."""
    from clients import scenario_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from transformers import LlamaForCausalLM

    dev = scenario_device()
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    rank, res = dist.get_rank(), {}

    def run(name, fix=None, capacity=8 << 30):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(width=128, attn_implementation="sdpa")).to(dev)
        if fix:  # in place of the user's fully_shard calls, with their mesh
            exec(compile(fix, "<wrap.too_coarse fix>", "exec"), {"model": model, "mesh": mesh})
        else:
            fully_shard(model, mesh=mesh)
        for m in model.modules():  # gloo's tuned setting (its all-gathers block the host otherwise)
            if isinstance(m, FSDPModule):
                m._set_unshard_async_op(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with fsdp_doctor.watch(model, opt, out_dir=str(out / name), capacity_bytes=capacity,
                               profile=ProfileSchedule(first=3, active=2)) as doc:
            losses = []
            for step in range(6):  # each replica its own batch
                g = torch.Generator().manual_seed(1000 * step + rank)
                tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(dev)
                loss = F.cross_entropy(model(input_ids=tok[:, :-1]).logits.float().flatten(0, 1),
                                       tok[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                doc.step()
                losses.append(loss.item())
        dist.barrier()
        cfg = fsdp_doctor.load_run(out / name).ranks[rank].config
        rows = fsdp_doctor.build_report(fsdp_doctor.load_run(out / name)).overlap.per_unit
        res[name] = {**_outcome(out / name, rank), "losses": losses, "mesh": cfg.mesh, "fsdp_dims": cfg.fsdp_dims,
                     "shard_sizes": sorted({u.shard_size for u in cfg.units if u.param_count}),
                     "sizes": sorted({(r.unit, r.collective, r.bytes_per_call) for r in rows if r.unit != "(other)"}),
                     # each row's group as its bus bandwidth implies it (busbw_factor's inverse)
                     "groups": sorted({(r.collective, _implied_group(r)) for r in rows if r.unit != "(other)"})}
        return res[name]["findings"]

    return _each_fixed(run, res, [("coarse", "wrap.too_coarse", {})])


def run_loops(out: Path) -> dict:
    """Two loops that are not gradient accumulation, each rank's records and the report of each: a GAN's generator
    run twice with gradients into one loss, one backward per optimizer step, beside its sharded discriminator
    (``gan``, a new-user trial's loop.py); a NaN/inf guard that skips optimizer.step() in steps 2 and 5 of 8 and
    zeroes the gradients all the same, after the guard (``skip``) and at the loop's top (``skip_top``). Each also run
    unwatched: its losses and final shards compared."""
    from fsdp_doctor.analyze.steps import usable_steps
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.fmt import apart_texts

    rank = dist.get_rank()

    def model(seed: int, d: int = 32, vocab: int = 64):
        """The trial's generator (the embedding, encoder layers as units, the head), smaller."""
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Embedding(vocab, d), *(torch.nn.TransformerEncoderLayer(
            d, 2, 2 * d, batch_first=True, dropout=0.0) for _ in range(2)), torch.nn.Linear(d, vocab))
        for layer in m[1:-1]:
            fully_shard(layer)
        fully_shard(m)
        return m

    def loop(mode: str, out_dir=None):
        G = model(0)
        # D as the trial's: its units "0" and "2" and its root, whose collectives the trace's labels (which name no
        # model) count under G's units of the same names: twice a step (D's own backward, and G's loss through it)
        torch.manual_seed(1)
        D = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1))
        fully_shard(D[0])
        fully_shard(D[2])
        fully_shard(D)
        opt, opt_d = torch.optim.AdamW(G.parameters(), lr=1e-3), torch.optim.AdamW(D.parameters(), lr=1e-3)
        kw = dict(profile=ProfileSchedule(first=4, warmup=1, active=1), capacity_bytes=1 << 30)
        ctx = fsdp_doctor.watch(G, opt, out_dir=str(out_dir), **kw) if out_dir else contextlib.nullcontext()
        losses = []
        with ctx as doctor:
            for step in range(8):
                g = torch.Generator().manual_seed(100 * step + rank)
                t = torch.randint(0, 64, (2, 9), generator=g)
                x, y = t[:, :-1], t[:, 1:]
                if mode == "gan":
                    with torch.no_grad():
                        fake = torch.softmax(G(x), -1)
                    real = F.one_hot(y, 64).float()
                    (F.softplus(-D(real)).mean() + F.softplus(D(fake)).mean()).backward()
                    opt_d.step()
                    opt_d.zero_grad()
                    # the generator twice with gradients (for D's input, and for a cross-entropy term): one backward
                    loss = F.softplus(-D(torch.softmax(G(x), -1))).mean() + F.cross_entropy(
                        G(x).flatten(0, 1), y.flatten())
                    loss.backward()
                    opt.step()
                else:
                    if mode == "skip_top":
                        opt.zero_grad()
                    loss = F.cross_entropy(G(x).flatten(0, 1), y.flatten()) * (
                        float("inf") if step in (2, 5) else 1.0)
                    loss.backward()
                    ok = torch.tensor([float(all(torch.isfinite(p.grad.to_local()).all() for p in G.parameters()))])
                    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                    if ok.item() == 1.0:
                        opt.step()
                if mode != "skip_top":
                    opt.zero_grad()
                opt_d.zero_grad()
                losses.append(loss.item().hex())
                if doctor is not None:
                    doctor.step()
        return losses, [p.to_local().detach().clone() for p in G.parameters()]

    res = {}
    for mode in ("gan", "skip", "skip_top"):
        losses, params = loop(mode, out / mode)
        base_losses, base_params = loop(mode)
        run = fsdp_doctor.load_run(out / mode)
        report = build_report(run) if rank == 0 else None
        steps = run.ranks[rank].steps
        res[mode] = {"identical": losses == base_losses and same_tensors(params, base_params),
                     "steps": [s.step for s in steps], "micro_batches": [s.micro_batches for s in steps],
                     "backwards": [getattr(s, "backwards", None) for s in steps],
                     "skipped": [s.step for s in steps if getattr(s, "optimizer_skipped", False)],
                     "accum": None if report is None else {
                         st.code: [st.status, st.reason] for st in report.rules if st.code.startswith("accum.")},
                     "reduce_scatters": None if report is None else sorted(
                         [r.unit, r.count_per_step] for r in report.overlap.per_unit
                         if r.rank == 0 and r.collective == "reduce_scatter"),
                     "apart": None if report is None else dict(apart_texts(report.steps)),
                     "statistics": [s.step for s in usable_steps(steps)]}
        dist.barrier()
    return res


def optimizers_in_backward(model):
    """torchtune's optimizer_in_bwd as its recipe sets it up (training.register_optim_in_bwd_hooks and
    create_optim_in_bwd_wrapper): each parameter's own AdamW, stepped and zeroed by a post-accumulate-grad hook (FSDP2
    calls it on the sharded parameter once its gradient is reduced); the wrapper maps parameter names to them."""
    optims = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

    def optim_step(param):
        optims[param].step()
        optims[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(optim_step)
    return types.SimpleNamespace(optim_map={n: optims[p] for n, p in model.named_parameters()})


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _optimizers_run(make, out_dir=None, give=True):
    """The reference GPT trained with the optimizers ``make(model)`` builds, ``(the object watch() is given, the
    optimizers, whether the loop steps them)``, watched into ``out_dir`` (None: without the doctor; ``give``
    False: watch() given None): losses, final shards, what is left on the optimizers after exit, the doctor, the
    optimizers, their state's bytes as they hold them."""
    model, forward = gpt()
    given, opts, in_loop = make(model)
    model._get_fsdp_state()._lazy_init()
    before = [hook_state(model, o) for o in opts]
    ctx = (fsdp_doctor.watch(model, given if give else None, out_dir=str(out_dir), profile=False) if out_dir
           else contextlib.nullcontext())
    losses = []
    with ctx as doctor:
        for step in range(STEPS):
            tok, tgt = batch(step)
            loss = F.cross_entropy(forward(tok).float().flatten(0, 1), tgt.flatten())
            loss.backward()
            for o in opts if in_loop else ():
                o.step()
                o.zero_grad()
            if doctor is not None:
                doctor.step()
            losses.append(loss.item())
    left = sorted({k for b, o in zip(before, opts) for k in diff(b, hook_state(model, o))})
    params = [p.to_local().detach().clone() for p in model.parameters()]
    state = sum(_local_bytes(v) for o in opts for st in o.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return losses, params, left, doctor, opts, state


def run_in_backward(out: Path) -> dict:
    """The same training without the doctor, watched with the wrapper (its optim_map) and with None: losses and
    final shards, what is left on the model and the optimizers after exit, the steps the doctor timed, the state's
    bytes as the optimizers hold them."""
    def make(model):
        wrapper = optimizers_in_backward(model)
        return wrapper, list(wrapper.optim_map.values()), False

    base_losses, base_params, *_ = _optimizers_run(make)
    res = {}
    for given in ("wrapper", "none"):
        losses, params, left, doctor, opts, state = _optimizers_run(make, out / given, give=given == "wrapper")
        res[given] = {"identical": losses == base_losses and same_tensors(params, base_params), "left": left,
                      "optimizers": len(opts), "state_bytes": state,
                      "in_backward_steps": doctor._timer.in_backward_steps}
    return res


def run_two_optimizers(out: Path) -> dict:
    """Muon on the blocks' matrices beside AdamW on the rest, both stepped in the loop, watched with the list of them:
    losses and final shards against the loop without the doctor, what is left on the optimizers after exit, the
    optimizer steps the doctor timed, the state's bytes as they hold them."""
    def make(model):
        mats = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]
        rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("layers."))]
        opts = [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]
        return opts, opts, True

    base_losses, base_params, *_ = _optimizers_run(make)
    losses, params, left, doctor, _, state = _optimizers_run(make, out / "two")
    return {"identical": losses == base_losses and same_tensors(params, base_params), "left": left,
            "optimizer_steps": doctor._timer.optimizer_steps, "steps": doctor.steps_done, "state_bytes": state}


def run_rank0_only(out: Path) -> dict:
    """watch() entered on rank 0 only (``if rank == 0``), the other rank training unwatched: each rank's losses and
    final shards against the loop without the doctor, and the ranks and steps the run holds. (Its entry's collective
    met the other rank's FSDP all-gather, which crashed both: a new-user trial.)"""
    def make(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return opt, [opt], True

    base_losses, base_params, *_ = _optimizers_run(make)
    losses, params, *_ = _optimizers_run(make, out / "rank0" if dist.get_rank() == 0 else None)
    dist.barrier()
    run = fsdp_doctor.load_run(out / "rank0")
    return {"identical": losses == base_losses and same_tensors(params, base_params), "ranks": sorted(run.ranks),
            "steps": len(run.ranks[0].steps), "world_size": run.world_size}


def run_optimizers(out: Path) -> dict:
    return {"in_backward": run_in_backward(out), "two": run_two_optimizers(out), "rank0_only": run_rank0_only(out)}


CASES = {"identity": run_identity, "aside": run_aside, "loops": run_loops, "trainer": run_trainer,
         "trainer_fixes": run_trainer_fixes, "trainer_gc": run_trainer_gc, "trainer_compiled": run_trainer_compiled,
         "tp_fixes": run_tp_fixes, "hsdp_fixes": run_hsdp_fixes, "hf_native_fixes": run_hf_native_fixes,
         "accelerate_fixes": run_accelerate_fixes, "accelerate_accum": run_accelerate_accum,
         "optimizers": run_optimizers}


if __name__ == "__main__":
    from clients import main

    sys.exit(main(sys.argv[1:], CASES))
