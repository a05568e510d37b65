"""wrap.params_in_root weighs its plan on the timeline of the rank with the lowest peak, the least disturbed.

traces/cpu/titan_root_gloo_late_buffer: the scenario matrix's row titan_blocks_only_2_ranks (torchtitan's llama, bf16
parameters, blocks and root only, 2 gloo ranks), recorded in the 1 run of 6 where rank 1's peak moved into the loss:
a 73,984 B gathered copy (a block's all-gather output) stayed alive from the first block's forward to the root's
backward, held by gloo's async work, so rank 1's peak step read 1,217,492 B at the loss, where the root's embedding
copy is gathered and the plan frees it (2.69%), and rank 0's read 1,160,404 B in the last block's backward, where
the plan frees nothing (-128 B). The rule warned on that run (CI's long tier failed on it); it is quiet now."""

from __future__ import annotations

from pathlib import Path

import fsdp_doctor
from fsdp_doctor.diagnose import estimate as E
from fsdp_doctor.diagnose.base import Context
from fsdp_doctor.diagnose.rules import wrap as W

RUN = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "titan_root_gloo_late_buffer"


def _ctx():
    run = fsdp_doctor.load_run(RUN)
    return Context(run, fsdp_doctor.build_report(run))


def test_the_ranks_timelines_disagree_on_what_the_plan_frees():
    """The recorded run is what it says: per rank, the peak and what the plan leaves of it, from its timeline."""
    ctx = _ctx()
    (root,) = E.roots(E.param_units(ctx))
    per_rank = E.memory_per_rank(ctx)
    got = {r: (m.peak_bytes, m.peak_at.phase, m.peak_bytes - W._peak_as_units(m, root, E.non_root(E.param_units(ctx))))
           for r, m in per_rank.items()}
    assert got == {"0": (1_160_404, "in_backward", -128), "1": (1_217_492, "in_loss", 32_768)}, got
    assert E.peak_memory(ctx) is per_rank["1"]


def test_root_plan_gain_is_the_calm_ranks():
    ctx = _ctx()
    (root,) = E.roots(E.param_units(ctx))
    assert W._peak_after_plan(ctx, root, E.non_root(E.param_units(ctx)), [], 1_217_492) == 1_217_492 + 128
    s = next(s for s in fsdp_doctor.build_report(ctx.run).rules if s.code == "wrap.params_in_root")
    assert s.status == "quiet", (s.status, s.reason)
    assert "would lower the peak by 0 B, 0.0% of the 1.16 MiB peak (worth it from 1%" in s.reason, s.reason


HF = RUN.parent / "hf_llama_root_gloo_late_buffer"


def test_a_disturbed_rank_whose_peak_moved_off_the_plans_gain_does_not_hide_it():
    """traces/cpu/hf_llama_root_gloo_late_buffer: the matrix's row hf_llama_head_in_root (an HF Llama, its final norm
    and lm_head left in the root: 19% of the parameters), recorded in a run where rank 0 kept a gathered copy
    (48,640 B) alive into the loss, 3 runs of 12 here. Its peak moved there, where the head is gathered either way
    (the plan frees nothing: 0 B); rank 1's stayed in the last layer's backward, where the plan frees the head's
    gathered copy (65,664 B, 2.5%). Weighing the plan by the least gain any rank showed read 0 B, and the rule was
    quiet on the row's planted finding (CI's long tier); by the rank with the lowest peak, it fires."""
    run = fsdp_doctor.load_run(HF)
    ctx = Context(run, fsdp_doctor.build_report(run))
    (root,) = E.roots(E.param_units(ctx))
    blocks = E.non_root(E.param_units(ctx))
    got = {r: (m.peak_bytes, m.peak_at.phase, m.peak_bytes - W._peak_as_units(m, root, blocks))
           for r, m in E.memory_per_rank(ctx).items()}
    assert got == {"0": (2_625_856, "in_loss", 0), "1": (2_577_216, "in_backward", 65_664)}, got
    assert W._peak_after_plan(ctx, root, blocks, [], 2_625_856) == 2_625_856 - 65_664
    (f,) = [f for f in ctx.report.findings if f.code == "wrap.params_in_root"]
    assert f.predicted.peak_bytes_before == 2_625_856 and f.predicted.peak_bytes_after == 2_625_856 - 65_664, f.predicted
