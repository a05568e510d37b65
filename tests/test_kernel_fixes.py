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
    _assert_fix_switches_to_sdpa(LlamaForCausalLM(cfg).eval(), f.recommendation.code, seq=32)


def _assert_fix_switches_to_sdpa(model, code: str, seq: int) -> None:
    """``code`` run on ``model`` (built with eager attention): the profiler sees scaled_dot_product_attention and no
    softmax afterwards, and the output is the same attention, computed fused."""
    tokens = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, ref = _ops(model, tokens)
        assert "aten::softmax" in before and "aten::scaled_dot_product_attention" not in before
        exec(compile(code, "<kernels.eager_attention fix>", "exec"), {"model": model})
        after, out = _ops(model, tokens)
    assert "aten::scaled_dot_product_attention" in after and "aten::softmax" not in after, sorted(after)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _eager_finding(tmp_path, units: str, config):
    """kernels.eager_attention on a trace of ``units`` blocks, read with the run's configuration record ``config``
    (watch() records it; None: a plain trace)."""
    from types import SimpleNamespace

    from fsdp_doctor.diagnose import RULES, Context

    report = _report(tmp_path, attention_trace(EAGER, units=units))
    rule = next(r for r in RULES if r.code == "kernels.eager_attention")()
    (f,) = rule.match(Context(run=SimpleNamespace(config=config, ranks={}, path=str(tmp_path)), report=report))
    return f


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_eager_attention_fix_for_any_hugging_face_layout_from_the_records(tmp_path, arch):
    """GPT-2 (blocks transformer.h.N) and BERT (bert.encoder.layer.N) are Hugging Face models whose units a plain
    trace cannot tell from anyone's: there the advice was words only. watch() records the model's attention
    implementation where it can switch it, so the fix is printed, and applied to the model built eager it runs
    scaled_dot_product_attention with no softmax left and the same output. Where the model already asks for sdpa,
    or is no Hugging Face model (a model.layers.N tree of the user's own), no code."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    from fsdp_doctor.record.config_snapshot import attn_implementation
    from fsdp_doctor.records import RunConfig

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg, cls, units = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64), \
            GPT2LMHeadModel, "transformer.h.{}"
    else:
        cfg, cls, units = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64), BertForMaskedLM, \
            "bert.encoder.layer.{}"
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    record = RunConfig(rank=0, world_size=1, backend="nccl", device="cuda:0", attn_implementation=attn_implementation(model))
    assert record.attn_implementation == "eager"
    assert _eager_finding(tmp_path, units, None).recommendation.code == ""  # a plain trace: layout unknown
    f = _eager_finding(tmp_path, units, record)
    assert "model.set_attn_implementation('sdpa')" in f.recommendation.code
    _assert_fix_switches_to_sdpa(model, f.recommendation.code, seq=16)
    assert attn_implementation(model) == "sdpa"
    asked = _eager_finding(tmp_path, units, RunConfig(rank=0, world_size=1, backend="nccl", device="cuda:0",
                                                     attn_implementation="sdpa"))
    assert asked.recommendation.code == "" and "already asks for 'sdpa'" in asked.recommendation.text
    # a model of the user's own whose blocks happen to be model.layers.N: no Hugging Face method to call
    assert attn_implementation(torch.nn.Linear(2, 2)) is None
    plain = RunConfig(rank=0, world_size=1, backend="nccl", device="cuda:0")
    assert _eager_finding(tmp_path, "model.layers.{}", plain).recommendation.code == ""


@pytest.mark.long  # (the long tier: real runs of 10-30 s on a slow host, tests/conftest.py)
def test_eager_attention_fix_for_a_model_without_sdpa_switches_it_to_flex_attention(tmp_path):
    """Gemma2 runs eager by default: its attention soft-caps the scores, and transformers marks it without SDPA, so
    the fix the rule used to print, set_attn_implementation('sdpa'), raised ValueError when pasted. watch() records
    what the model says it supports (flex_attention, flash_attention_2): the fix switches it to flex_attention,
    which on this CPU (forward only: flex has no CPU backward; the GPU row reruns training) leaves no attention
    softmax and gives the same logits, soft-capping included. flash_attention_2 is named in words (it needs the
    flash-attn package). A model with none of them gets words and no predicted gain."""
    pytest.importorskip("transformers")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from fsdp_doctor.record.config_snapshot import attn_implementation, attn_implementations
    from fsdp_doctor.records import RunConfig

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = Gemma2ForCausalLM(cfg).eval()
    if attn_implementation(model) != "eager":  # (transformers 5.20, the newest on Python 3.10, gives Gemma2 SDPA)
        import transformers
        pytest.skip(f"transformers {transformers.__version__} runs Gemma2 with {attn_implementation(model)}")
    assert cfg.attn_logit_softcapping
    assert attn_implementations(model) == ["flex_attention", "flash_attention_2"]
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):  # what the old fix did when pasted
        model.set_attn_implementation("sdpa")
    record = RunConfig(rank=0, world_size=1, backend="nccl", device="cuda:0", attn_implementation="eager",
                       attn_implementations=attn_implementations(model))
    f = _eager_finding(tmp_path, "model.layers.{}", record)
    code = f.recommendation.code
    assert code.splitlines()[-1] == "model.set_attn_implementation('flex_attention')" and "sdpa" not in code, code
    import scenario_matrix as M

    assert any(k in code for k in M.COMPILES)  # its GPU row's rerun compiles: a launch of its own there
    assert "or to flash_attention_2, where the flash-attn package is installed" in f.recommendation.text
    assert "set_attn_implementation('sdpa') would raise" in f.recommendation.text
    assert f.predicted.step_ms_after < f.predicted.step_ms_before
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, ref = _ops(model, tokens)
        assert "aten::softmax" in before
        exec(compile(code, "<kernels.eager_attention fix>", "exec"), {"model": model})
        after, out = _ops(model, tokens)
    assert attn_implementation(model) == "flex_attention"
    assert "aten::softmax" not in after, sorted(after)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # a model that supports no fused implementation: no code, no gain predicted
    none = _eager_finding(tmp_path, "model.layers.{}", RunConfig(
        rank=0, world_size=1, backend="nccl", device="cuda:0", attn_implementation="eager", attn_implementations=[]))
    assert none.recommendation.code == "" and "supports no fused implementation" in none.recommendation.text
    assert none.predicted.step_ms_after is None
    # a Llama says it has all three: the fix stays sdpa
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=64))
    assert attn_implementations(llama) == ["sdpa", "flex_attention", "flash_attention_2"]
    assert attn_implementations(torch.nn.Linear(2, 2)) is None
