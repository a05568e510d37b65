"""wrap.too_coarse's peak where the split moves it into the loss: a Hugging Face causal LM as one unit, its loss computed
in its forward (``labels=``) over a vocabulary large beside its blocks. The whole model's peak is in its forward with
every parameter gathered; split, the peak is the loss's (the logits' gradients), where the plan's units hold only the
final norm and head. Read from the pair of blocks gathered at the old peak, a new-user trial's Jamba was predicted
30.60 -> 27.34 MiB and measured 28.45 (an MPT-style GPT 9.83 for 10.58): the rule now takes the marks from the end of
the forward to the head's backward with what the plan keeps gathered there as a floor.

Run as a user would: 2 gloo ranks, the printed plan executed in place of ``fully_shard(model)`` in a fresh run."""

from __future__ import annotations

import textwrap

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
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    shard(model, fix)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for ids in torch.randint(0, 4096, (4, 4, 64), generator=g):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_whole_model_split_peak_in_the_loss_is_predicted(tmp_path):
    whole = record_two_ranks(tmp_path, _SCRIPT, "whole")
    (f,) = [f for f in whole.findings if f.code == "wrap.too_coarse"]
    fix = tmp_path / "fix.py"
    fix.write_text(f.recommendation.code)
    split = record_two_ranks(tmp_path, _SCRIPT, "split", str(fix))
    after = max(split.memory.per_rank.values(), key=lambda m: m.peak_bytes)
    assert after.peak_at.phase == "in_loss", after.peak_at  # (moved out of the model's forward)
    # within 1% where the pair of blocks read 3-4% low (see above)
    assert abs(f.predicted.peak_bytes_after - after.peak_bytes) <= 0.01 * after.peak_bytes, \
        (f.predicted.peak_bytes_after, after.peak_bytes, f.predicted.peak_bytes_before)
