"""A Hugging Face DETR (object detection) as its fine-tuning recipe runs it: the ResNet backbone frozen (transformers
freezes it), the encoder's and decoder's layers sharded by the user, the root holding the backbone, its stem, the input
projection, the query embeddings and the heads. A new-user trial (transformers 5.25, 2 gloo ranks, 128 x 128 images):

- wrap.params_in_root's plan made each frozen backbone stage a unit, and on its rerun FSDP2's default backward
  prefetch all-gathered the last stage in every backward of the first encoder layer, though no stage runs backward
  (prefetch.frozen_gathered, raised by the doctor's own plan). The plan now gives that layer a backward prefetch list
  of its own (itself), as the plans splitting a whole-model unit did.
- Under a budget just above the peak, memory.temporaries placed the peak "in the loss and output head" and spoke of
  logits over a vocabulary: the peak was the ResNet stem's outputs in the root's forward, before its first unit. It
  now says where (before the first unit, naming the stem) and what lowers them there.

The loss is the heads' outputs' mean (DETR's Hungarian-matched loss needs SciPy, which the suite does not install);
what the tests read (units, gathers, the peak's place) is the same."""

from __future__ import annotations

import textwrap

import msgspec
import pytest

from conftest import SHARD_OR_FIX, gloo_worker, record_two_ranks

pytest.importorskip("transformers")

_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    """
) + SHARD_OR_FIX + gloo_worker(
    """
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig
    backbone = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                            out_features=["stage4"])
    cfg = DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=64,
                     encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=256, decoder_ffn_dim=256, num_queries=10, num_labels=5, dropout=0.0)
    model = DetrForObjectDetection(cfg)
    if fix:
        shard(model, fix)
    else:  # the user's: each encoder and decoder layer, then the root
        for layer in [*model.model.encoder.layers, *model.model.decoder.layers]:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for x in torch.randn(4, 4, 3, 128, 128, generator=g):
            o = model(pixel_values=x, pixel_mask=torch.ones(4, 128, 128, dtype=torch.long))
            (o.logits.float().pow(2).mean() + o.pred_boxes.float().mean()).backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)

_STAGES = [f"model.backbone.model.encoder.stages.{i}" for i in range(4)]
_LINES = "unit = model.get_submodule('model.encoder.layers.0')\n# itself: gathered already, nothing to gather\n" \
         "unit.set_modules_to_backward_prefetch([unit])"


def _plan(report) -> str:
    (f,) = [f for f in report.findings if f.code == "wrap.params_in_root"]
    return f.recommendation.code


@pytest.mark.slow
def test_params_in_root_plan_for_a_frozen_backbone_keeps_the_first_layer_from_gathering_it(tmp_path):
    layers = record_two_ranks(tmp_path, _SCRIPT, "layers")
    (root,) = [u for u in layers.units if u.is_root]
    assert {f"{s}.layers.0.layer.0.convolution" for s in _STAGES} <= set(root.frozen_modules), root.frozen_modules
    code = _plan(layers)
    assert "for block in model.model.backbone.model.encoder.stages.children():" in code, code
    assert code.endswith(_LINES), code
    assert "the 4 unit(s) before model.encoder.layers.0 in forward hold no trainable" in code, code

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    by = {u.name: u for u in fixed.units}
    assert set(_STAGES) <= set(by), sorted(by)
    assert all(by[s].trainable_sharded_bytes == 0 for s in _STAGES)
    assert by["model.encoder.layers.0"].backward_prefetch == ["model.encoder.layers.0"]
    (fg,) = [s for s in fixed.rules if s.code == "prefetch.frozen_gathered"]
    assert fg.status == "quiet", (fg.status, fg.reason)


@pytest.mark.long
def test_the_plan_without_its_prefetch_lines_gathers_the_last_frozen_stage(tmp_path):
    """The plan as it was (no list on the first encoder layer), pasted: the last stage gathered in every backward."""
    code = _plan(record_two_ranks(tmp_path, _SCRIPT, "layers"))
    bare = tmp_path / "bare.py"
    bare.write_text(code[:code.index("# the 4 unit(s) before")])
    (g,) = [g for g in record_two_ranks(tmp_path, _SCRIPT, "bare", str(bare)).findings
            if g.code == "prefetch.frozen_gathered"]
    assert _STAGES[-1] in g.title, g.title


@pytest.mark.slow
def test_temporaries_of_a_stem_before_the_first_unit_are_not_called_logits(tmp_path):
    """The peak is in the root's forward before its first unit (the stem's convolution, normalization and activation
    outputs at 128 x 128): under a budget 10% above it memory.temporaries says so, names the stem, and says nothing of
    logits or a vocabulary."""
    import fsdp_doctor

    record_two_ranks(tmp_path, _SCRIPT, "layers")
    run = fsdp_doctor.load_run(tmp_path / "layers")
    report = fsdp_doctor.build_report(run)
    pm = max(report.memory.per_rank.values(), key=lambda m: m.peak_bytes)
    assert (pm.peak_at.unit, pm.peak_at.phase) == ("", "in_forward"), pm.peak_at
    for rd in run.ranks.values():
        rd.config = msgspec.structs.replace(rd.config, capacity_bytes=int(pm.peak_bytes * 1.1))
    (f,) = [f for f in fsdp_doctor.build_report(run).findings if f.code == "memory.temporaries"]
    assert f.title.endswith("in the root's own forward"), f.title
    assert f.evidence["where"] == "root", f.evidence
    text = f.recommendation.text
    assert ("before its first unit (model.model.backbone.model.embedder, each block of "
            "model.model.backbone.model.encoder.stages, model.model.query_position_embeddings, "
            "model.model.input_projection)") in text, text
    assert "logits" not in text and "vocabulary" not in text, text
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in text, text
    assert not f.recommendation.code
