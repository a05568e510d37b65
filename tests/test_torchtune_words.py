"""A run one of torchtune's recipes drove gets its fixes where that recipe's user puts them (without torchtune
installed: the recorded run below is a real recipe's).

traces/cpu/torchtune_recipe_accumulate: torchtune 0.6.1's full_finetune_distributed, copied with `tune cp` and
watched in its train() (the README's two lines; two more because torch.cpu has no empty_cache and torchtune reads CUDA
memory stats on rank 0), on 2 gloo ranks: a 2-layer Llama-2-shaped decoder (vocab 4096, dim 64) from a local HF
checkpoint, gradient_accumulation_steps 2, activation checkpointing, CEWithChunkedOutputLoss (the decoder's output
head called once per chunk of 8), clip_grad_norm 1.0, 12 optimizer steps, a profiler window at steps 6-7. Each unit
reduce-scatters every micro-batch (the recipe never turns gradient sync off). Pasted into that recipe as printed, the
accumulation fix took the finding away with the losses equal to the bit, and so did the root's
set_reshard_after_forward and the asynchronous unshard (`recipe_acc.py`, `recipe_last.py`, `recipe_async.py` of the
trial)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import msgspec

import fsdp_doctor
from fsdp_doctor.diagnose import snippets as S
from fsdp_doctor.present.fmt import fixes_note
from fsdp_doctor.diagnose.rules.optim import _recipe_reductions
from fsdp_doctor.record.torchtune import torchtune_recipe
from fsdp_doctor.records import TORCHTUNE_DRIVER
from fsdp_doctor.report_sections import FIX_LANGUAGES, FIX_PLACES, Recommendation

RUN = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "torchtune_recipe_accumulate"

#: torchtune's recipe base class, as its module names it (no torchtune import: read by its module's name)
FTRecipeInterface = type("FTRecipeInterface", (), {"__module__": "torchtune.recipe_interfaces"})


class MyRecipe(FTRecipeInterface):
    def train(self):
        return torchtune_recipe(sys._getframe())

    def train_through_a_helper(self):
        return (lambda: torchtune_recipe(sys._getframe()))()


def test_the_recipe_is_read_from_the_frame_that_called_watch():
    assert MyRecipe().train().file == Path(__file__).name  # the file the user edits: the copy tune cp gave them
    assert MyRecipe().train_through_a_helper().file == Path(__file__).name
    assert torchtune_recipe(sys._getframe()) is None  # a loop of the user's own (this test function)
    other = type("Recipe", (), {"__module__": "my_recipes", "run": lambda self: torchtune_recipe(sys._getframe())})
    assert other().run() is None  # a class named like one, not torchtune's


def _report():
    run = fsdp_doctor.load_run(RUN)
    assert (run.config.driver, run.config.recipe, run.config.output_chunks) == (TORCHTUNE_DRIVER, "recipe_doc.py", 8)
    return run, fsdp_doctor.build_report(run)


def test_recorded_recipe_run_says_its_fixes_in_the_recipe():
    _, report = _report()
    got = {f.code: f.recommendation for f in report.findings}
    acc = got["accum.sync_every_micro_batch"]
    assert acc.where == "torchtune_backward" and not acc.inputs, (acc.where, acc.inputs)
    assert "self._model.set_requires_gradient_sync(is_last_micro_batch)" in acc.code, acc.code
    assert "is_last_micro_batch = (idx + 1) % self._gradient_accumulation_steps == 0" in acc.code, acc.code
    assert "recipe_doc.py" in acc.text and max(map(len, acc.code.splitlines())) <= 80, acc
    # pasted, it syncs on the batches after which the recipe steps the optimizer (every 2nd: (idx + 1) % 2 == 0)
    calls = []
    for idx in range(6):
        me = types.SimpleNamespace(_gradient_accumulation_steps=2,
                                   _model=types.SimpleNamespace(set_requires_gradient_sync=calls.append))
        exec(acc.code, {"self": me, "idx": idx})
    assert calls == [False, True] * 3, calls
    # fixes on the sharded model go into its _setup_model, after training.shard_model, where the model is `model`
    for code in ("reshard.last_unit", "prefetch.sync_unshard"):
        rec = got[code]
        assert rec.where == "torchtune_setup" and "model." in rec.code and "self._model" not in rec.code, (code, rec)
        assert "_setup_model" in rec.text, rec.text
    assert "training.shard_model" in FIX_PLACES["torchtune_setup"]
    # every fix names the recipe's own model: no "rename `model` to yours" over them
    assert fixes_note(report.findings) == ""


def test_the_chunked_output_head_stays_in_the_root():
    """The decoder calls its output head once per chunk (8): a unit of its own would issue its collectives per call,
    as many as each rank's sequence splits into (the trial's run with it one: aborted at the second step, resharded
    after forward; hung, kept gathered). The embedding gains less here than its collectives cost on gloo: quiet."""
    _, report = _report()
    assert "wrap.params_in_root" not in {f.code for f in report.findings}
    why = next(s.reason for s in report.rules if s.code == "wrap.params_in_root")
    assert "output, called once per chunk of the sequence (num_output_chunks=8)" in why, why
    assert "tok_embeddings, a unit of its own, would free at most 1.00 MiB" in why, why


def test_an_unchunked_decoders_plan_is_torchtunes_config_line():
    """Without chunks (a loss on the whole logits), the head can be a unit of its own: the plan is the config's
    custom_sharded_layers, which the recipe's training.shard_model reads, the embedding and the head named and the
    final norm (256 B, under 5% of what moves) left in the root."""
    run, _ = _report()
    for rd in run.ranks.values():
        rd.config = msgspec.structs.replace(rd.config, output_chunks=None)
    report = fsdp_doctor.build_report(run)
    f = next(f for f in report.findings if f.code == "wrap.params_in_root")
    rec = f.recommendation
    assert rec.where == "torchtune_config" and FIX_LANGUAGES[rec.where] == "YAML", rec.where
    assert rec.code.splitlines()[-1] == "custom_sharded_layers: ['tok_embeddings', 'output']", rec.code
    assert "model.norm stays in the root" in rec.text, rec.text
    assert f.predicted.peak_bytes_after < f.predicted.peak_bytes_before, f.predicted


def test_a_recipe_that_does_not_pass_the_config_on_is_told_to():
    """torchtune 0.6.1's knowledge distillation builds its student without the config's custom_sharded_layers (its
    teacher's _setup_model gets it): the config line alone left the embedding in the root (the trial's units were
    unchanged). The plan then says the recipe's line as well, over the config's."""
    run, _ = _report()
    for rd in run.ranks.values():
        rd.config = msgspec.structs.replace(rd.config, output_chunks=None, recipe_custom_layers=False)
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "wrap.params_in_root")
    lines = f.recommendation.code.splitlines()
    assert lines[1] == '#     custom_sharded_layers=cfg.get("custom_sharded_layers", None),', lines
    assert lines[-1] == "custom_sharded_layers: ['tok_embeddings', 'output']", lines
    assert "does not pass custom_sharded_layers on to the _setup_model" in f.recommendation.text


def test_other_fixes_are_made_for_the_recipe_or_left_alone():
    plan = Recommendation(text="t", code="fully_shard(model.tok_embeddings)", where="unsharded")
    S.for_torchtune(plan, "r.py")
    assert (plan.code, plan.where) == ("fully_shard(model.tok_embeddings)", "torchtune_plan")
    loop = Recommendation(text="t", code="optimizer.zero_grad(set_to_none=True)\nmodel.train()", where="loop")
    S.for_torchtune(loop, "r.py")
    assert loop.code == "self._optimizer.zero_grad(set_to_none=True)\nself._model.train()", loop.code
    assert loop.where == "torchtune_train"
    # a fix on the built optimizer: in its setup(), after it builds self._optimizer (optim.untrained_params' freezing)
    built = Recommendation(text="t", code="stepped = {id(p) for g in optimizer.param_groups for p in g['params']}\n"
                                          "for param in model.parameters():", where="optimizer")
    S.for_torchtune(built, "r.py")
    assert built.code == ("stepped = {id(p) for g in self._optimizer.param_groups for p in g['params']}\n"
                          "for param in self._model.parameters():"), built.code
    assert built.where == "torchtune_optimizer" and "self._setup_optimizer" in FIX_PLACES[built.where], built
    for code, where in (("import os\nos.environ['X'] = '1'", "startup"),
                        ("gc.freeze()  # optimizer built", "optimizer")):
        other = Recommendation(text="t", code=code, where=where)
        S.for_torchtune(other, "r.py")
        assert (other.code, other.where, other.text) == (code, where, "t")


def test_the_fused_step_is_the_configs_key():
    """traces/cpu/torchtune_recipe_unfused: full_finetune_distributed as tests/test_torchtune.py runs it (2 gloo
    ranks, the 2-layer decoder, no accumulation), its config's AdamW with fused: False, stepping the shards in torch's
    for-loop (4.8 ms of a 58.8 ms step, fused predicted 1.0 ms). Its fix read ``for group in
    optimizer.param_groups`` "after your optimizer is built": the recipe builds it from its config, whose key is the
    fix (given after --config as printed, the step measured 0.997 ms and the rule went quiet: that test)."""
    import yaml

    report = fsdp_doctor.build_report(fsdp_doctor.load_run(RUN.parent / "torchtune_recipe_unfused"))
    (f,) = [f for f in report.findings if f.code == "optim.unfused_step"]
    rec = f.recommendation
    assert (rec.where, FIX_LANGUAGES[rec.where]) == ("torchtune_config", "YAML"), rec.where
    assert yaml.safe_load(rec.code) == {"optimizer": {"fused": True}}, rec.code
    assert "optimizer.fused=True" in rec.code and "recipe.py" in rec.text, rec
    assert (f.evidence["implementation"], f.evidence["tensors"]) == ("for-loop", 21), f.evidence
    assert f.evidence["fused_optimizer_ms_est"] < f.evidence["optimizer_ms_per_step"] / 3, f.evidence


#: torchtune 0.6.1's recipes' reductions at each optimizer step, as their train() writes them (a stand-in recipe file
#: per recipe: its train() reads the recipe, as watch() does, then returns before the lines below, which never run)
_RECIPE = """
import sys
from fsdp_doctor.record.torchtune import torchtune_recipe
FTRecipeInterface = type("FTRecipeInterface", (), {{"__module__": "torchtune.recipe_interfaces"}})

class Recipe(FTRecipeInterface):
    def setup(self, cfg):
{setup}
    def train(self):
        got = torchtune_recipe(sys._getframe())
        if got is not None:
            return got
{body}
"""
# (each recipe's line that builds the model it trains: knowledge distillation's passes the config's
# custom_sharded_layers to its teacher's _setup_model only)
_SETUP = """\
        self._model = self._setup_model(
            cfg_model=cfg.model,
            fsdp_cpu_offload=cfg.get("fsdp_cpu_offload", False),
{custom}        )
"""
_PASSED = """            custom_sharded_layers=cfg.get("custom_sharded_layers", None),\n"""
_KD = """\
        torch.distributed.all_reduce(num_tokens)
        torch.distributed.all_reduce(running_class_loss)
        torch.distributed.all_reduce(running_kd_loss)
        training.scale_grads(self._model, self.world_size / num_tokens)
"""
_DPO = """\
        policy_chosen, policy_rejected, chosen_logits, rejected_logits = self.concatenated_forward(self._model, batch)
        del chosen_logits, rejected_logits
        with torch.no_grad(), disable_adapter(self._model):
            (reference_chosen, reference_rejected, _, _) = self.concatenated_forward(self._model, batch)
        loss = self._loss_fn(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
        loss.backward()
        torch.distributed.all_reduce(
            running_loss, op=torch.distributed.ReduceOp.AVG
        )
        torch.distributed.all_reduce(num_tokens)
        for key in running_metrics:
            torch.distributed.all_reduce(
                running_metrics[key], op=torch.distributed.ReduceOp.AVG
            )
"""


def _read(tmp_path, name: str, body: str, passed: bool = True):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(_RECIPE.format(body=body, setup=_SETUP.format(custom=_PASSED if passed else "")))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Recipe().train()


def test_the_recipes_reductions_named_as_it_writes_them(tmp_path):
    """optim.step_comm named full_finetune's running_loss in every recipe: knowledge distillation has none (its
    running_class_loss and running_kd_loss), and DPO's num_tokens feeds only its tokens/s, not a gradient scaling."""
    kd = _read(tmp_path, "kd", _KD, passed=False)
    assert (kd.file, kd.reduced, kd.scaled_by) == ("kd.py", ["num_tokens", "running_class_loss", "running_kd_loss"],
                                                   "num_tokens")
    assert kd.custom_layers is False
    text = _recipe_reductions(kd.file, kd.reduced, kd.scaled_by)
    assert "needs num_tokens (the prediction keeps it)" in text, text
    assert "Only its log reads running_class_loss, running_kd_loss" in text and "reduce them only" in text, text
    assert "running_loss," not in text
    dpo = _read(tmp_path, "dpo", _DPO)
    assert (dpo.reduced, dpo.scaled_by, dpo.custom_layers) == (
        ["running_loss", "num_tokens", "each running_metrics[key]"], None, True)
    assert (dpo.unread, kd.unread) == (["_"], [])  # the reference forward's logits, bound to `_` and never read
    text = _recipe_reductions(dpo.file, dpo.reduced, dpo.scaled_by)
    assert "needs" not in text, text
    assert "Only its log reads running_loss, num_tokens, each running_metrics[key]" in text, text
    # a recipe that reduces nothing in its train(): none named
    assert _read(tmp_path, "plain", "        pass\n").reduced == []


#: torchtune 0.6.1's lora_dpo_distributed, watched as the README says (profile=False: records only), on 2 gloo ranks:
#: the 2-layer decoder with LoRA on q, v, output projections and the MLP, preference pairs from a local JSON file,
#: gradient_accumulation_steps 2, activation checkpointing, 12 optimizer steps. Its train() binds the reference
#: forward's returns, its logits among them, to `_` and never reads them; `del _` pasted right after that line took
#: memory.outputs_kept away, the peak 16.33 -> 13.77 MiB as predicted (tests/test_torchtune.py runs it)
DPO_RUN = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "torchtune_dpo_reference"


def test_dpo_reference_forward_kept_is_named_as_the_recipe_binds_it():
    from fsdp_doctor.present.fmt import no_grad_text

    run = fsdp_doctor.load_run(DPO_RUN)
    cfg = run.config
    assert (cfg.recipe, cfg.recipe_unread, cfg.recipe_scaled_by, cfg.recipe_custom_layers) == (
        "recipe_dpo.py", ["_"], None, True)
    assert cfg.recipe_reduced == ["running_loss", "num_tokens", "each running_metrics[key]"]
    report = fsdp_doctor.build_report(run)
    f = next(f for f in report.findings if f.code == "memory.outputs_kept")
    rec = f.recommendation
    assert rec.code.splitlines()[-1] == "del _" and rec.where == "torchtune_train" and not rec.inputs, rec
    assert "binds a forward's returns to _ in its train() and never reads it" in rec.text, rec.text
    assert f.predicted.peak_bytes_after < f.predicted.peak_bytes_before - (2 << 20), f.predicted
    # the reference forward runs in every step: part of it, not an evaluation (nor one to keep gathered where the
    # capacity is known: eval.regather had fired on its 2 per step, with a fix around an evaluate() it lacks)
    assert no_grad_text(report.steps).startswith("Forward passes without gradients in every step"), report.steps
    for rd in run.ranks.values():
        rd.config = msgspec.structs.replace(rd.config, capacity_bytes=20 << 20)
    st = next(st for st in fsdp_doctor.build_report(run).rules if st.code == "eval.regather")
    assert st.status == "quiet" and "one per micro-batch (a reference forward" in st.reason, st


def test_temporaries_of_a_chunked_output_are_not_told_to_chunk():
    """torchtune's recipe computes its output in 8 chunks (num_output_chunks, for CEWithChunkedOutputLoss): its
    recorded peak, in the root's backward, holds 39.4% temporaries. Under a budget 5% above the peak and with 2% of
    the peak moved from the optimizer state to them (constructed: the rule fires from 40%), memory.temporaries says the
    chunks are there already and names the levers left, not the chunked loss the recipe uses."""
    from fsdp_doctor.diagnose import diagnose

    run, report = _report()
    pm = max(report.memory.per_rank.values(), key=lambda m: m.peak_bytes)
    assert pm.peak_at.unit == "" and pm.peak_at.phase == "in_backward"
    moved = int(0.02 * pm.peak_bytes)
    for m in report.memory.per_rank.values():
        m.capacity_bytes = int(pm.peak_bytes / 0.95)
    pm.peak_breakdown = {**pm.peak_breakdown, "temporaries": pm.peak_breakdown["temporaries"] + moved,
                         "optimizer_state": pm.peak_breakdown["optimizer_state"] - moved}
    (f,) = [f for f in diagnose(run, report) if f.code == "memory.temporaries"]
    text = f.recommendation.text
    assert f.evidence["where"] == "loss" and "in 8 chunks already (num_output_chunks" in text, text
    assert "torchtune's CEWithChunkedOutputLoss), which upcasts" in text and "smaller micro-batch" in text, text
    assert "the loss computed in chunks" not in text and not f.recommendation.code
