"""wrap.params_in_root on a vision-language model (a tiny Hugging Face Llava: a CLIP vision tower and a Llama, the
Llama's blocks and the root sharded, the vision tower's blocks left in the root). The plan made a unit of every
module holding the root's parameters: the vision tower's embeddings, its two norms and the projector, 0.4% of the
peak or less each, four units and twelve collectives a step more (a new-user trial), beside the embedding and the
final norm and head, which the peak does hold. Without tied modules the root left with nothing has no
collectives; those small modules now stay in it where each, and all of them together, would free under 1% of the
peak, and a comment in the plan says why. The finding's text names the modules the plan shards, not their children
(it listed ``embeddings.patch_embedding`` beside ``embeddings``, and each module of each vision block:
``model.get_submodule('model.vision_tower.encoder.layers.0.self_attn.k_proj')``, ... (+29)).

Run as a user would: 2 gloo ranks, the printed plan executed in place of the script's fully_shard calls in a fresh
run."""

from __future__ import annotations

import textwrap

import pytest

from conftest import LLAVA_LOOP, TINY_LLAVA, gloo_worker, record_two_ranks

_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    def shard(model, fix):
        if fix:  # in place of the fully_shard calls, as printed
            exec(open(fix).read(), {"model": model})
            return
        for layer in model.model.language_model.layers:  # (the vision tower's left in the root)
            fully_shard(layer)
        fully_shard(model)
    """
) + gloo_worker(TINY_LLAVA + "shard(model, fix)\n" + LLAVA_LOOP)

_SMALL = ("model.vision_tower.embeddings", "model.vision_tower.pre_layrnorm", "model.vision_tower.post_layernorm",
          "model.multi_modal_projector")


@pytest.mark.slow
def test_small_modules_of_the_root_stay_there_rather_than_units_of_their_own(tmp_path):
    base = record_two_ranks(tmp_path, _SCRIPT, "base")
    (f,) = [f for f in base.findings if f.code == "wrap.params_in_root"]
    code, text = f.recommendation.code, f.recommendation.text
    for m in _SMALL:
        assert f"fully_shard(model.{m}," not in code, code
    stays = " ".join(line.lstrip("# ") for line in code.splitlines() if line.startswith("#"))
    # (named as the code names them: model.model.vision_tower..., where "model.vision_tower..." read beside it)
    said = ", ".join(f"model.{m}" for m in _SMALL)
    assert f"{said} stay in the root" in stays and "4 units would add 12 collectives" in stays, code
    assert "fully_shard(model.model.language_model.embed_tokens, mesh=mesh)" in code, code
    assert "fully_shard([model.model.language_model.norm, model.lm_head], mesh=mesh," in code, code
    assert ("(each block of model.model.vision_tower.encoder.layers, model.model.language_model.embed_tokens, "
            "model.model.language_model.norm, model.lm_head; model.model.vision_tower.embeddings, ") in text, text
    assert "patch_embedding" not in text and "get_submodule" not in text, text

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    # the vision tower's 4 blocks, the embedding, the final norm and head
    assert len(fixed.units) == len(base.units) + 6, [u.name for u in fixed.units]
    warned = lambda rep: {g.code for g in rep.findings if g.severity == "warning"}  # noqa: E731
    # (the vision block after the hidden state Llava takes, a unit of its own now, shows it never runs backward:
    # optim.never_updated, tests/test_never_updated.py; inside the root, it had no timing of its own)
    assert "wrap.params_in_root" not in warned(fixed), warned(fixed)
    assert warned(fixed) - {"optim.never_updated"} <= warned(base), warned(fixed)
    predicted = f.predicted.peak_bytes_after
    assert abs(fixed.memory.peak_bytes - predicted) <= 0.1 * predicted, (fixed.memory.peak_bytes, predicted)
