"""optim.never_updated on a vision-language model (a tiny Hugging Face Llava: a CLIP vision tower and a Llama, every
block and the root sharded, the vision tower trained): Llava's projector takes the vision tower's hidden state at
vision_feature_layer=-2, the one before its last layer, so that layer runs its forward every step for an output
nothing reads. It never runs backward, its parameters never get a gradient, and FSDP2's default backward prefetch
gathers it in vain (a new-user trial: the prefetch snippet already left it out, prefetch.frozen_gathered's quiet
reason said "every unit runs backward"). The fix removes the layers after that hidden state and takes the last one,
the same: pasted before the fully_shard calls, the losses are bit-identical, the finding is gone and the peak at most
the predicted one (a ceiling), within 10% of it.

Run as a user would: 2 gloo ranks, the printed fix executed before the script's fully_shard calls in a fresh run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import LLAVA_LOOP, TINY_LLAVA, gloo_worker, record_two_ranks

_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    """
) + gloo_worker(TINY_LLAVA + textwrap.dedent(
    """
    if fix:  # before the fully_shard calls, as printed
        exec(open(fix).read(), {"model": model})
    for layer in model.model.vision_tower.encoder.layers:
        fully_shard(layer)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    fully_shard(model)
    """
) + LLAVA_LOOP)


def _losses(tmp_path: Path, name: str) -> list:
    return [json.loads((tmp_path / f"{name}.losses{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_a_vision_layer_no_output_reads_is_removed_and_the_loss_is_the_same(tmp_path):
    base = record_two_ranks(tmp_path, _SCRIPT, "base")
    (f,) = [f for f in base.findings if f.code == "optim.never_updated"]
    assert f.units == ["model.vision_tower.encoder.layers.3"] and f.severity == "warning", f.units
    assert "vision_feature_layer=-2 takes the vision tower's hidden state before them" in f.recommendation.text
    code = f.recommendation.code
    assert f.recommendation.where == "before_shard", f.recommendation.where
    assert "del model.model.vision_tower.encoder.layers[3:]\n" in code, code
    assert "model.config.vision_feature_layer = -1" in code and "num_hidden_layers = 3" in code, code
    # the quiet rule that said "every unit runs backward" names it
    frozen = next(s for s in base.rules if s.code == "prefetch.frozen_gathered")
    assert "model.vision_tower.encoder.layers.3, after it, runs no backward" in frozen.reason, frozen.reason

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    assert _losses(tmp_path, "fixed") == _losses(tmp_path, "base")  # (bit-identical: the same hidden state)
    assert len(fixed.units) == len(base.units) - 1, [u.name for u in fixed.units]
    warned = lambda rep: {g.code for g in rep.findings if g.severity == "warning"}  # noqa: E731
    assert "optim.never_updated" not in warned(fixed) and warned(fixed) <= warned(base), warned(fixed)
    predicted = f.predicted.peak_bytes_after  # a ceiling: the layer's shard at least, what it saved where held
    assert f.predicted.at_most and predicted < base.memory.peak_bytes
    assert 0.9 * predicted <= fixed.memory.peak_bytes <= predicted, (fixed.memory.peak_bytes, predicted)


def test_the_cut_reads_the_hidden_state_the_layer_index_takes():
    """Known answers for which blocks vision_feature_layer leaves unread (n blocks give n + 1 hidden states): -2 of 4
    leaves block 3, 2 of 4 blocks 2 and 3, -1 none; any other set of units gets no cut (words only)."""
    from fsdp_doctor.diagnose.rules.optim import _feature_layer_cut
    from test_diagnose_rules import build, healthy_units

    ctx = build(healthy_units(), vision_feature_layer=-2)[0]
    assert _feature_layer_cut(ctx, ["layers.3"]) == ("layers", 3, -2)
    assert _feature_layer_cut(ctx, ["layers.2", "layers.3"]) is None
    assert _feature_layer_cut(build(healthy_units(), vision_feature_layer=2)[0], ["layers.2", "layers.3"]) == \
        ("layers", 2, 2)
    assert _feature_layer_cut(build(healthy_units(), vision_feature_layer=-1)[0], ["layers.3"]) is None
    assert _feature_layer_cut(build(healthy_units())[0], ["layers.3"]) is None


_ACCELERATE = textwrap.dedent(
    """
    import os
    import sys
    import torch
    import torch.distributed as dist
    """
) + gloo_worker(TINY_LLAVA + textwrap.dedent(
    """
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    sys.path.insert(0, os.environ["FSDP_DOCTOR_TESTS"])
    from recorder_cases import force_fsdp

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    # its default policy: the model's _no_split_modules (each CLIP and Llama layer, the vision embeddings)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=True)
    force_fsdp(accelerator.state, plugin)  # (accelerate enables FSDP on GPUs only)
    if fix:  # with the Accelerator built, before prepare(), as printed
        exec(open(fix).read(), {"model": model, "accelerator": accelerator})
    model = accelerator.prepare(model)
    """
) + LLAVA_LOOP)


@pytest.mark.slow
def test_under_accelerates_plugin_the_fix_goes_before_prepare(tmp_path, monkeypatch):
    """The same model sharded by accelerate's FSDP2 plugin (its default policy, the model's _no_split_modules): the
    fix goes before accelerator.prepare(model), which shards it; pasted there, the losses are bit-identical and the
    finding is gone."""
    pytest.importorskip("accelerate")
    monkeypatch.setenv("FSDP_DOCTOR_TESTS", str(Path(__file__).parent))
    base = record_two_ranks(tmp_path, _ACCELERATE, "base")
    (f,) = [f for f in base.findings if f.code == "optim.never_updated"]
    assert f.recommendation.where == "accelerate" and "del model.model.vision_tower.encoder.layers[3:]" in \
        f.recommendation.code, (f.recommendation.where, f.recommendation.code)
    fix = tmp_path / "fix.py"
    fix.write_text(f.recommendation.code)
    fixed = record_two_ranks(tmp_path, _ACCELERATE, "fixed", str(fix))
    assert _losses(tmp_path, "fixed") == _losses(tmp_path, "base")
    assert "optim.never_updated" not in {g.code for g in fixed.findings}
    assert fixed.memory.peak_bytes <= f.predicted.peak_bytes_after, (fixed.memory.peak_bytes, f.predicted)


@pytest.mark.parametrize("driver, where, m", [(None, "before_shard", "model"),
                                              ("transformers.Trainer", "trainer", "trainer.model")])
def test_the_fix_names_the_model_where_the_user_holds_it(driver, where, m):
    """The fix from records of a Llava-shaped run (the reference GPT's units, layers.3 never run backward,
    vision_feature_layer=-2): in the user's own loop on `model`, before the fully_shard calls; under a Hugging Face
    Trainer on the model it holds, `trainer.model`, before trainer.train() (a trial's Trainer run: pasted there, the
    losses bit-identical, the finding gone, the peak 30.65 -> 30.40 MiB as predicted)."""
    from test_diagnose_rules import _never_updated_ctx, run_rule

    ctx = _never_updated_ctx()
    ctx.run.config.vision_feature_layer, ctx.run.config.driver = -2, driver
    (f,) = run_rule("optim.never_updated", ctx)
    assert f.recommendation.where == where, f.recommendation.where
    code = f.recommendation.code
    assert f"del {m}.layers[3:]\n" in code and f"{m}.config.vision_feature_layer = -1" in code, code
    assert f"{m}.config.vision_config.num_hidden_layers = 3" in code, code
    # (gloo: its forward, 6.0 ms, and the backward all-gather prefetched for it, 0.8 ms, a floor of the gain)
    assert f.predicted.at_most and f.predicted.step_ms_after == pytest.approx(110.0 - 6.8), f.predicted
