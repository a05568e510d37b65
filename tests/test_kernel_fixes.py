"""The kernel rules' fixes applied to a real model on this CPU: kernels.eager_attention's fix for a Hugging Face
decoder (the snippet the rule prints for a trace of HF units, tests/test_kernel_rules.py) switches an HF Llama
built with eager attention to scaled_dot_product_attention: the profiler sees the fused op and no attention
softmax afterwards, and the model's output is unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_kernel_rules import EAGER, _report, attention_trace  # noqa: E402


def _ops(model, tokens) -> tuple[set[str], torch.Tensor]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = model(tokens).logits
    return {e.key for e in prof.key_averages()}, out


def test_eager_attention_fix_switches_an_hf_llama_to_sdpa(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    f = next(f for f in _report(tmp_path, attention_trace(EAGER, units="model.layers.{}")).findings
             if f.code == "kernels.eager_attention")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, ref = _ops(model, tokens)
        assert "aten::softmax" in before and "aten::scaled_dot_product_attention" not in before
        exec(compile(f.recommendation.code, "<kernels.eager_attention fix>", "exec"), {"model": model})
        after, out = _ops(model, tokens)
    assert "aten::scaled_dot_product_attention" in after and "aten::softmax" not in after, sorted(after)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)  # the same attention, computed fused
