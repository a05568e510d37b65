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
from fsdp_doctor.record.tracker import _torchtune_recipe
from fsdp_doctor.records import TORCHTUNE_DRIVER
from fsdp_doctor.report_sections import FIX_LANGUAGES, FIX_PLACES, Recommendation

RUN = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "torchtune_recipe_accumulate"

#: torchtune's recipe base class, as its module names it (no torchtune import: read by its module's name)
FTRecipeInterface = type("FTRecipeInterface", (), {"__module__": "torchtune.recipe_interfaces"})


class MyRecipe(FTRecipeInterface):
    def train(self):
        return _torchtune_recipe(sys._getframe())

    def train_through_a_helper(self):
        return (lambda: _torchtune_recipe(sys._getframe()))()


def test_the_recipe_is_read_from_the_frame_that_called_watch():
    assert MyRecipe().train() == Path(__file__).name  # the file the user edits: the copy tune cp gave them
    assert MyRecipe().train_through_a_helper() == Path(__file__).name
    assert _torchtune_recipe(sys._getframe()) is None  # a loop of the user's own (this test function)
    other = type("Recipe", (), {"__module__": "my_recipes", "run": lambda self: _torchtune_recipe(sys._getframe())})
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


def test_other_fixes_are_made_for_the_recipe_or_left_alone():
    plan = Recommendation(text="t", code="fully_shard(model.tok_embeddings)", where="unsharded")
    S.for_torchtune(plan, "r.py")
    assert (plan.code, plan.where) == ("fully_shard(model.tok_embeddings)", "torchtune_plan")
    loop = Recommendation(text="t", code="optimizer.zero_grad(set_to_none=True)\nmodel.train()", where="loop")
    S.for_torchtune(loop, "r.py")
    assert loop.code == "self._optimizer.zero_grad(set_to_none=True)\nself._model.train()", loop.code
    assert loop.where == "torchtune_train"
    other = Recommendation(text="t", code="optimizer.zero_grad()", where="optimizer")
    S.for_torchtune(other, "r.py")
    assert (other.code, other.where, other.text) == ("optimizer.zero_grad()", "optimizer", "t")
