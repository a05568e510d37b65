"""A run OLMo-core's Trainer drove gets its fixes where that Trainer's user puts them (without OLMo-core installed:
the recorded run below is a real one's).

traces/cpu/olmo_blocks_tight: OLMo-core 3.0.0's Trainer attached with ``trainer.add_callback("fsdp_doctor",
fsdp_doctor.olmo.DoctorCallback(out_dir=..., capacity_bytes=100 MiB))``, on 2 gloo ranks: its olmo2 model (4 blocks,
width 256, vocabulary 2,048) sharded by its train module under the 'blocks' wrapping strategy (the LM head left in
the root), 2 micro-batches of 4 x 128 tokens a step, AdamW, 10 steps, a profiler window at steps 6-7
(tests/olmo_cases.py's blocks_tight case; tests/test_olmo.py reruns it with the fixes pasted)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec

import fsdp_doctor
from fsdp_doctor.diagnose import snippets as S
from fsdp_doctor.present.fmt import fixes_note
from fsdp_doctor.records import OLMO_DRIVER
from fsdp_doctor.report_sections import FIX_PLACES, Recommendation

RUN = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "olmo_blocks_tight"


def _report():
    run = fsdp_doctor.load_run(RUN)
    assert run.config.driver == OLMO_DRIVER, run.config.driver
    return run, fsdp_doctor.build_report(run)


def test_recorded_olmo_run_says_its_fixes_in_its_configs_and_its_train_module():
    """Each fix is OLMo-core's setting on the train module's config (the wrapping strategy, the checkpointed
    modules) or code after the train module is built (its model and optimizer, its micro-batch context): none for
    fully_shard calls or a loop the user does not write. A new-user trial read them "in your training loop" and
    "after your fully_shard calls"."""
    _, report = _report()
    got = {f.code: f.recommendation for f in report.findings}
    assert {c: r.where for c, r in got.items()} == {
        "ac.recommended": "olmo_config", "wrap.params_in_root": "olmo_config",
        "accum.sync_every_micro_batch": "olmo_built", "prefetch.sync_unshard": "olmo_built"}, got
    assert got["wrap.params_in_root"].code.endswith("train_module_config.dp_config.wrapping_strategy = 'full'")
    assert "--train_module.dp_config.wrapping_strategy=full on the command line" in " ".join(
        ln.lstrip("# ") for ln in got["wrap.params_in_root"].code.splitlines())
    assert ("train_module_config.ac_config = TransformerActivationCheckpointingConfig(\n    mode='selected_modules',\n"
            "    modules=['blocks.0', 'blocks.1'])") in got["ac.recommended"].code, got["ac.recommended"].code
    assert "for module in train_module.model.modules():" in got["prefetch.sync_unshard"].code
    assert "train_module.model.set_requires_gradient_sync(is_last_micro_batch)" in \
        got["accum.sync_every_micro_batch"].code
    for code, rec in got.items():
        compile(rec.code, code, "exec")  # (valid Python as printed)
        assert max(map(len, rec.code.splitlines())) <= 80, rec.code
        assert " model." not in f" {rec.code}" and "optimizer." not in rec.code, rec.code
        assert rec.where in FIX_PLACES and not set(rec.inputs) - {"train_module_config"}, rec.inputs
    assert fixes_note(report.findings).startswith("The fixes call OLMo-core's objects as its example scripts do")


class _Model:
    def __init__(self):
        self.calls = []

    def set_requires_gradient_sync(self, value):
        self.calls.append(("sync", value))

    def set_reshard_after_backward(self, value):
        self.calls.append(("reshard", value))


class _TrainModule:
    """OLMo-core's train module as its micro-batch fixes use it: its model and the context it runs each micro-batch
    in (``_train_microbatch_context(micro_batch_idx, num_micro_batches)``)."""

    def __init__(self):
        self.model = _Model()
        self.entered = []

    @contextlib.contextmanager
    def _train_microbatch_context(self, micro_batch_idx, num_micro_batches):
        self.entered.append(micro_batch_idx)
        yield


def test_micro_batch_fixes_run_before_each_micro_batch_and_two_pasted_nest():
    """The accumulation fix and the regather fix each wrap the train module's micro-batch context: their switch is
    set before each micro-batch, True on the last only, and OLMo-core's own context still runs. Pasted one after the
    other, the second wraps the first (the method each wraps is bound where it is pasted: looked up by name when
    called, the first found the second and recursed)."""
    _, report = _report()
    accum = next(f.recommendation.code for f in report.findings if f.code == "accum.sync_every_micro_batch")
    regather = Recommendation(text="", where="loop", inputs={S.LAST_MICRO_BATCH: "..."},
                              code="# keep them gathered\nmodel.set_reshard_after_backward(is_last_micro_batch)")
    S.for_olmo(regather, "accum.regather")
    assert regather.where == "olmo_built" and not regather.inputs, regather
    tm = _TrainModule()
    for code in (accum, regather.code):
        exec(compile(code, "<fix>", "exec"), {"train_module": tm})
    for idx in range(3):
        with tm._train_microbatch_context(idx, 3):
            pass
    assert tm.entered == [0, 1, 2]
    assert tm.model.calls == [("reshard", False), ("sync", False), ("reshard", False), ("sync", False),
                              ("reshard", True), ("sync", True)], tm.model.calls


def test_olmo_wrapping_strategy_of_a_plan():
    each = "for block in model.blocks.children():\n    fully_shard(block, mesh=mesh)\n"
    root = "fully_shard(model, mesh=mesh)"
    assert S.olmo_strategy(each + "fully_shard(model.embeddings)\nfully_shard(model.lm_head,\n"
                           "            reshard_after_forward=False)\n" + root) == "full"
    assert S.olmo_strategy(each + "fully_shard(model.embeddings)\n" + root) == "blocks"
    assert S.olmo_strategy(each + "fully_shard(model.embeddings)\nfully_shard(model.lm_head.norm)\n" + root) is None
    assert S.olmo_strategy("fully_shard(model.embeddings)\n" + root) is None  # (no block loop: not OLMo-core's)


def _checkpointed_tree(wrapped: set[str]):
    """The recorded run's units with ``wrapped`` blocks inside checkpoint wrappers, as OLMo-core's ac_config makes
    them (the wrapper is the block; its module the unit)."""
    run = fsdp_doctor.load_run(RUN)
    units = [msgspec.structs.replace(u, name=f"{u.name}{S._CKPT}", modules=[f"{m}{S._CKPT}" for m in u.modules])
             if u.name in wrapped else u for u in run.config.units]
    return S.Tree.of(units)


def test_checkpointing_off_is_its_ac_config_over_what_stays_checkpointed():
    """ac.unneeded's fix turns off the wrappers it names: OLMo-core's ac_config without them, None where none stays,
    its selected modules otherwise; ac.recommended's names join those already checkpointed, every block its 'full'
    mode."""
    blocks = {f"blocks.{i}" for i in range(4)}
    t = _checkpointed_tree(blocks)
    off = Recommendation(text="", where="sharded", code=S.remove_checkpointing(sorted(blocks), []))
    S.for_olmo(off, "ac.unneeded", t=t)
    assert off.where == "olmo_config" and off.code.endswith("train_module_config.ac_config = None"), off.code
    some = Recommendation(text="", where="sharded", code=S.remove_checkpointing(["blocks.0", "blocks.1"], []))
    S.for_olmo(some, "ac.unneeded", t=t)
    assert "modules=['blocks.2', 'blocks.3'])" in some.code, some.code
    more = Recommendation(text="", where="before_shard", code=S.checkpoint_modules(["blocks.2", "blocks.3"], "x"))
    S.for_olmo(more, "ac.recommended", t=_checkpointed_tree({"blocks.0", "blocks.1"}))
    assert "TransformerActivationCheckpointingConfig(\n    mode='full')" in more.code, more.code


def test_fixes_without_a_setting_go_on_the_built_model_or_say_where():
    """A fix on the sharded model goes after the build, on train_module.model, its words for fully_shard calls
    OLMo-core's (it makes them); a loop fix with no place in OLMo-core's configs says where such a change goes."""
    zero2 = Recommendation(text="", where="sharded", code="# keep them gathered;\n" + S.RESHARD_IN_CALLS + "\n"
                           "model.get_submodule('blocks.0').set_reshard_after_forward(False)")
    S.for_olmo(zero2, "reshard.zero2_affordable")
    assert zero2.where == "olmo_built" and S.RESHARD_IN_CALLS not in zero2.code, zero2.code
    assert "train_module.model.get_submodule('blocks.0')" in zero2.code and "apply_fsdp reshards" in zero2.code
    # renamed past 80 columns (OLMo-core's HSDP trial: 91), the calls on named units are a loop over their names
    calls = "\n".join(f"model.get_submodule('blocks.{i}').set_reshard_after_forward(False, recurse=False)"
                      for i in (3, 0))
    long = Recommendation(text="", where="sharded", code="# keep them gathered\n" + calls)
    S.for_olmo(long, "reshard.zero2_affordable")
    assert long.code.endswith("# keep them gathered\nnames = ['blocks.3', 'blocks.0']\nfor name in names:\n"
                              "    unit = train_module.model.get_submodule(name)\n"
                              "    unit.set_reshard_after_forward(False, recurse=False)"), long.code
    compiled = Recommendation(text="", where="sharded", code=S.compile_code(S.Tree.of(_report()[0].config.units)))
    S.for_olmo(compiled, "kernels.launch_bound")
    assert compiled.code == "for block in train_module.model.blocks.children():\n    block.compile()  # in place, " \
        "after fully_shard", compiled.code
    assert "compile_model=True on your train module's config" in compiled.text, compiled.text
    loop = Recommendation(text="Log less.", where="loop", code="dist.all_reduce(total)")
    S.for_olmo(loop, "optim.step_comm")
    assert loop.code == "dist.all_reduce(total)" and loop.text == "Log less." + S.OLMO_ELSEWHERE, loop


def test_policy_dtype_fixes_are_its_data_parallel_config_dtypes():
    """numerics.reduce_dtype's and precision.autocast_fp32_params's fixes re-shard the model with another
    MixedPrecisionPolicy; OLMo-core makes the policy from its data-parallel config's dtypes, which the fixes set
    instead (its autocast_precision kept, as the rule keeps a user's autocast; each pasted into a trial's run: the
    finding gone)."""
    plan = "mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,\n    reduce_dtype=torch.float32)\n..."
    reduce = Recommendation(text="", where="unsharded", code=plan)
    S.for_olmo(reduce, "numerics.reduce_dtype")
    assert reduce.where == "olmo_config" and "from olmo_core.config import DType" in reduce.code, reduce.code
    assert reduce.code.endswith("train_module_config.dp_config.reduce_dtype = DType.float32"), reduce.code
    cast = Recommendation(text="", where="unsharded", code=plan)
    S.for_olmo(cast, "precision.autocast_fp32_params")
    assert cast.code.endswith("train_module_config.dp_config.param_dtype = DType.bfloat16"), cast.code
    for rec in (reduce, cast):
        compile(rec.code, "fix", "exec")
        assert max(map(len, rec.code.splitlines())) <= 80, rec.code


def test_the_callback_without_olmo_core_says_what_it_needs_in_one_line():
    """fsdp_doctor.olmo imports without OLMo-core (every module of the recorder imports alone); building its callback
    there fails at once, naming what is missing, before any training starts."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("olmo_core") is not None:
        pytest.skip("OLMo-core is importable here")
    from fsdp_doctor.olmo import DoctorCallback

    with pytest.raises(ImportError, match=r"^fsdp_doctor.olmo.DoctorCallback is OLMo-core's Trainer callback: "
                                          r"olmo_core does not import here \(No module named 'olmo_core'\)$"):
        DoctorCallback(out_dir="unused")


def test_a_trace_of_its_profiler_callback_says_the_fixes_in_its_words(tmp_path):
    """OLMo-core's ProfilerCallback records Python frames by default (with_stack): its Trainer's frames
    ("olmo_core/train/trainer.py(761): fit") in a plain trace say it drove the run. A trial's trace of it (2 gloo
    ranks, 2 micro-batches a step, no doctor) read "after your fully_shard calls" and "in your training loop"; the
    fixes are those of a recorded run now (pasted there: both findings gone, the step 1.17 -> 1.09 s). Known answer:
    test_accum_plain_trace's trace of 2 micro-batches, with and without such a frame."""
    from test_accum_plain_trace import WORLD, _accum_trace

    def fix(frame: bool):
        out = tmp_path / str(frame)
        out.mkdir()
        for r in range(WORLD):
            b = _accum_trace(r, 2, memory=False, shapes=False)
            if frame:
                b.x("olmo_core/train/trainer.py(761): fit", 1.0, 29000.0, cat="python_function")
            b.write(out / f"rank{r}.json")
        rep = fsdp_doctor.build_report(fsdp_doctor.load_run(out))
        assert {pr.driver for pr in rep.overlap.per_rank.values()} == {OLMO_DRIVER if frame else None}
        return next(f.recommendation for f in rep.findings if f.code == "accum.sync_every_micro_batch")

    plain, olmo = fix(False), fix(True)
    assert plain.where == "loop" and "model.set_requires_gradient_sync(is_last_micro_batch)" in plain.code, plain
    assert olmo.where == "olmo_built" and not olmo.inputs, (olmo.where, olmo.inputs)
    assert "train_module._train_microbatch_context = before_micro_batch" in olmo.code, olmo.code
    assert "train_module.model.set_requires_gradient_sync(is_last_micro_batch)" in olmo.code, olmo.code
