"""compile.recompile_limit on real runs: a Hugging Face Llama whose decoder layers are each compiled in place
(``layer.compile()``, then ``fully_shard`` per layer and on the root, 2 gloo ranks) compiles a variant of the layers'
shared forward per layer (Dynamo guards on each layer's own KV-cache slot, its index), so past Dynamo's default
recompile limit (8) every later layer ran eager, with one warning in the log and nothing in the report (a new-user
trial). The doctor records the hit (which code, the limit, the last reason, the step, the layer it hit in) and the
frames each layer's compiled call compiled, and the rule names the layers that ran eager; its fix, pasted where it
says in a fresh process, leaves every layer compiled and the rule quiet. Dynamo's own cache (its entries for the
layers' forward) and its counters are read beside the doctor's records, as a check from outside them. The layers
compile through aot_eager here (inductor's C++ code for this CPU takes minutes and changes no guard)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import record_two_ranks

pytestmark = [pytest.mark.slow, pytest.mark.long]  # (two-rank runs compiling 8-10 layers: ~30 s each)

_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    LAYERS = {layers}

    def worker(rank, port, out, fix):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        import fsdp_doctor
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
            fully_shard(layer)
        fully_shard(model)
        code, where = (open(fix).read(), open(fix + ".where").read()) if fix else ("", "")
        assert where in ("", "model"), where
        if code:  # after the model is built and wrapped, before the training loop
            exec(code, {{"model": model}})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doctor:
            for _ in range(4):
                x = torch.randint(0, 128, (4, 32), generator=g)
                model(x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
                doctor.step()
        # Dynamo's own account: the compiled variants its cache holds for the layers' forward, and the limits hit
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.utils import counters
        forward = type(model.model.layers[0]).forward
        with open(f"{{out}}.dynamo{{rank}}", "w") as f:
            json.dump({{"entries": len(_debug_get_cache_entry_list(forward.__code__)),
                       "limit_hits": sum(n for k, n in counters["unimplemented"].items() if "limit" in k)}}, f)
        dist.destroy_process_group()
    """
)


def _run(tmp_path: Path, layers: int, name: str, fix: Path | None = None):
    report = record_two_ranks(tmp_path, _SCRIPT.format(layers=layers), name, str(fix) if fix else "")
    dynamo = [json.loads((tmp_path / f"{name}.dynamo{r}").read_text()) for r in range(2)]
    return report, dynamo


def _status(report):
    return next(s for s in report.rules if s.code == "compile.recompile_limit")


def test_layers_past_the_recompile_limit_are_named_and_the_fix_compiles_them(tmp_path):
    """10 layers: Dynamo's cache holds 8 variants of the layers' forward and layers 8 and 9 run eager, on each rank;
    the rule names them, from the frames their compiled calls compiled (none), with the limit, the code and the last
    reason. Its fix (recompile_limit 20: a variant per layer and room for one more each) pasted after the model is
    wrapped: 10 variants cached, every layer compiled, no limit hit, the rule quiet."""
    pytest.importorskip("transformers")
    before, dynamo = _run(tmp_path, 10, "before")
    assert [d["entries"] for d in dynamo] == [8, 8] and [d["limit_hits"] for d in dynamo] == [1, 1], dynamo
    (f,) = [f for f in before.findings if f.code == "compile.recompile_limit"]
    ev = f.evidence
    assert f.severity == "warning" and f.ranks == [0, 1]
    assert ev["eager_modules"] == ["model.layers.8", "model.layers.9"] and ev["eager_count"] == 2, ev
    assert ev["eager_from"].startswith("measured") and ev["hit_in_module"] == "model.layers.8"
    assert (ev["limit_type"], ev["limit"], ev["hit_at_step"]) == ("recompile_limit", 8, 0)
    assert ev["function"] == "forward_with_checkpointing (transformers/modeling_layers.py:89)", ev["function"]
    assert ev["modules_sharing_code"] == 10 and ev["modules_compiled"] == 8 and ev["classes"] == ["LlamaDecoderLayer"]
    assert ev["variants_per_module"] == 1 and (ev["limit_needed"], ev["limit_suggested"]) == (10, 20)
    assert ev["last_reason"] and "layers[7]" in ev["last_reason"], ev["last_reason"]
    assert f.units == ["model.layers.8", "model.layers.9"]
    assert f.title == "torch.compile left 2 of 10 LlamaDecoderLayer modules eager: Dynamo hit recompile_limit (8)"
    rec = f.recommendation
    assert rec.where == "model" and rec.code.splitlines()[-1] == "torch._dynamo.config.recompile_limit = 20"
    assert all(len(line) <= 80 for line in rec.code.splitlines()), rec.code
    # the eager layers' time against the compiled ones' (aot_eager fuses nothing: within the host's noise of it, and
    # then no step time is predicted, said; a noisy run that reads them 10% slower predicts what that costs)
    slower = ev["eager_unit_ms_p50"] >= 1.1 * ev["compiled_unit_ms_p50"]
    if slower:
        assert f.predicted.step_ms_before - f.predicted.step_ms_after == pytest.approx(ev["eager_extra_ms_per_step"],
                                                                                    abs=2e-3)
    else:
        assert f.predicted.step_ms_after is None and "No step time is predicted" in rec.text
    fix = tmp_path / "fix.py"
    fix.write_text(rec.code)
    Path(f"{fix}.where").write_text(rec.where)
    after, dynamo = _run(tmp_path, 10, "after", fix)
    assert [d["entries"] for d in dynamo] == [10, 10] and [d["limit_hits"] for d in dynamo] == [0, 0], dynamo
    assert "compile.recompile_limit" not in {x.code for x in after.findings}
    st = _status(after)
    assert st.status == "quiet" and st.reason == ("Dynamo hit no recompile limit: 10 module(s) compiled "
                                                  "(LlamaDecoderLayer); recompile_limit 20, "
                                                  "accumulated_recompile_limit 256"), st.reason
    import fsdp_doctor

    run = fsdp_doctor.load_run(tmp_path / "after")
    for rd in run.ranks.values():  # every layer's compiled call compiled its variant, in the first step
        assert set(rd.steps[0].unit_compiles) == {f"model.layers.{i}" for i in range(10)}, rd.steps[0].unit_compiles
        assert not any(s.recompile_limits for s in rd.steps)


def test_no_limit_hit_with_as_many_layers_as_the_limit(tmp_path):
    """8 layers, 8 variants: the limit is not hit, every layer compiles, and the rule says so."""
    pytest.importorskip("transformers")
    report, dynamo = _run(tmp_path, 8, "run")
    assert [d["entries"] for d in dynamo] == [8, 8] and [d["limit_hits"] for d in dynamo] == [0, 0], dynamo
    st = _status(report)
    assert st.status == "quiet" and st.reason == ("Dynamo hit no recompile limit: 8 module(s) compiled "
                                                  "(LlamaDecoderLayer); recompile_limit 8, "
                                                  "accumulated_recompile_limit 256"), st.reason


def test_the_gpu_row_runs_its_layers_past_the_limit_and_pastes_the_fix_on_the_model(tmp_path):
    """The scenario matrix's GPU row of this rule (gpu_hf_llama_recompile_limit: on a GPU 16 GPU-sized layers
    compiled with inductor, one NCCL rank, its predicted step gain checked there), shrunk on one gloo rank as the
    campaign's dry run runs it (aot_eager): the last 8 layers eager and named, the fix pasted where it says (after the
    model is built and wrapped: the runner's ``model`` place), every layer compiled in the rerun, the rule quiet and
    no new warning. Its step gain is the GPU's to check: here aot_eager's layers are no faster than eager ones."""
    pytest.importorskip("transformers")
    import scenario_matrix as M

    from clients import RECOMPILE_LAYERS

    row = M.BY_NAME["gpu_hf_llama_recompile_limit"]
    assert row.gpu and row.world == 1 and row.gpu_gain and row.tree == "hf_llama_layers_compiled"
    (o,) = M.run_matrix(tmp_path, [row]).values()
    assert not o.error and not o.after_error, o.error + o.after_error
    ev = o.finding.evidence
    assert RECOMPILE_LAYERS == 16 and ev["modules_sharing_code"] == 16 and ev["limit"] == 8, ev
    assert ev["eager_modules"] == [f"model.layers.{i}" for i in range(8, 16)], ev["eager_modules"]
    assert o.fix["where"] == "model" and o.fix["code"].endswith("recompile_limit = 32"), o.fix
    rc = o.recheck()
    assert rc["gone"] and (rc["figure_before"], rc["figure_after"]) == (8.0, 0.0) and not rc["new_warnings"], rc
    for rd in M.diagnosis(tmp_path / f"{row.name}_fixed")[0].ranks.values():
        assert set(rd.steps[0].unit_compiles) == {f"model.layers.{i}" for i in range(16)}, rd.steps[0].unit_compiles
