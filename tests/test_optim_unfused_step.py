"""optim.unfused_step: Adam or AdamW stepping FSDP2's sharded parameters on the host (CPUOffloadPolicy's shards, or a
CPU run's parameters) in torch's default loop, or foreach, for a material share of the step; the fused CPU kernel
makes the same update in one call. Its fix is optim.foreach_temporaries', applied here as printed."""

from __future__ import annotations

import pytest
import torch

from test_optim_fused import _findings
from test_optim_fused import _run as _blocks
from test_optim_fused import recorded_as_torch_holds_it

#: 8 blocks of 256 x 256 + 256: this one rank's elements and tensors (weights and biases)
_ELEMENTS, _TENSORS = 8 * (256 * 256 + 256), 16


def _run(out, fix: str = "", opt=None):
    """test_optim_fused's 8 blocks on one gloo rank, 8 steps, no budget: AdamW as torch picks it on the CPU (its loop)
    unless ``opt`` builds another, ``fix`` run on it as printed: (run read back, losses)."""
    return _blocks(out, fix, foreach=None, copies=None, steps=8, opt_class=opt)


def _diagnose(run):
    """(report, findings by code, statuses by code)."""
    statuses = []
    report, found = _findings(run, statuses)
    return report, found, {s.code: s for s in statuses}


def test_a_cpu_runs_looping_adamw_is_told_of_its_fused_step(tmp_path, gloo_one_rank):
    """AdamW's default on the CPU loops over the 16 tensors of this rank's 526,336 elements, an operator dispatch per
    tensor each: the finding says so with those counts, as a note (a CPU run: a GPU steps its parameters foreach on the
    device), its prediction the step's own optimizer time scaled by the table's costs. Applied as printed, the
    optimizer steps fused with the same losses, and the rule is quiet for it."""
    from fsdp_doctor.diagnose.estimate import cpu_step_ratio

    run, losses = _run(tmp_path / "loop")
    report, found, _ = _diagnose(run)
    assert report.run.optimizer_impl == "for-loop"
    f = found["optim.unfused_step"]
    ev = f.evidence
    assert f.severity == "info" and (ev["implementation"], ev["tensors"], ev["elements_per_rank"]) == (
        "for-loop", _TENSORS, _ELEMENTS), ev
    ratio = cpu_step_ratio("fused", "for-loop", _ELEMENTS, _TENSORS)
    assert ev["fused_optimizer_ms_est"] == pytest.approx(ev["optimizer_ms_per_step"] * ratio, abs=1e-3), ev
    p = f.predicted
    assert p.step_ms_before - p.step_ms_after == pytest.approx(ev["optimizer_ms_per_step"] * (1 - ratio), abs=2e-3)
    assert p.peak_bytes_after == p.peak_bytes_before == report.memory.peak_bytes, p  # (the loop makes no
    # intermediates of a group: the fused step frees none)
    assert "this run trains on the CPU" in f.recommendation.text and f.recommendation.where == "optimizer"
    # under a Hugging Face Trainer (its optimizer the Trainer's, built from TrainingArguments' optim): the same
    # switch, or the Trainer's fused AdamW by name (a trial's Qwen2, 8 layers of 256, optim='adamw_torch': 22.5 ms
    # a step, fused predicted 5.0, its callback-wrapped fix pasted: 6.00 ms, the losses the fused default's)
    from fsdp_doctor.records import TRAINER_DRIVER

    for rd in run.ranks.values():
        rd.config.driver = TRAINER_DRIVER
    text = _diagnose(run)[1]["optim.unfused_step"].recommendation.text
    assert "every group of the Trainer's optimizer" in text and "TrainingArguments(optim='adamw_torch_fused')" in text
    fixed, fixed_losses = _run(tmp_path / "fused", f.recommendation.code)
    after, found_after, statuses = _diagnose(fixed)
    assert fixed_losses == pytest.approx(losses, rel=1e-6, abs=1e-7)
    assert after.run.optimizer_impl == "fused" and "optim.unfused_step" not in found_after
    assert statuses["optim.unfused_step"].reason == "AdamW runs fused already"
    new = {c for c, g in found_after.items() if g.severity != "info"} - {c for c, g in found.items()
                                                                         if g.severity != "info"}
    assert not new, new


def test_sgd_on_the_cpu_is_left_alone(tmp_path, gloo_one_rank):
    """SGD's fused kernel has no DTensor sharding rule (optim.foreach_temporaries' table): no fix to offer."""
    run, _ = _run(tmp_path / "sgd", opt=lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9))
    _, found, statuses = _diagnose(run)
    assert "optim.unfused_step" not in found
    assert statuses["optim.unfused_step"].reason.startswith("SGD's fused kernel has no DTensor sharding rule"), (
        statuses["optim.unfused_step"])


def test_the_recorded_h100_offload_run_steps_adamw_in_a_loop_on_its_host():
    """The H100 row gpu_gpt_offload (CPUOffloadPolicy, AdamW as torch defaults it): its shards step on the host,
    torch's loop there, 86.4 ms of a 170.5 ms step (the device waiting). A warning on a GPU run, its fused step
    predicted from that time; offload.costly's (drop the offload: the state fits) beside it."""
    report, found, _ = _diagnose(recorded_as_torch_holds_it("gpu_gpt_offload"))
    assert report.run.optimizer_impl == "for-loop"
    f = found["optim.unfused_step"]
    ev = f.evidence
    assert f.severity == "warning" and ev["implementation"] == "for-loop", (f.severity, ev)
    assert ev["optimizer_ms_per_step"] == pytest.approx(86.4, abs=0.1) and ev["elements_per_rank"] > 9e6, ev
    assert 0.2 < ev["fused_optimizer_ms_est"] / ev["optimizer_ms_per_step"] < 0.35, ev
    assert "CPUOffloadPolicy keeps them in host memory, and the device waits" in f.recommendation.text
    assert "offload.costly" in found


def test_a_gpu_step_on_the_device_is_not_judged():
    """The tuned H100 row steps AdamW foreach on the device: the rule predicts only a host's step, and says so."""
    report, found, statuses = _diagnose(recorded_as_torch_holds_it("gpu_gpt_tuned"))
    assert report.run.optimizer_impl == "foreach" and "optim.unfused_step" not in found
    assert statuses["optim.unfused_step"].reason.startswith("AdamW steps the parameters on the GPU (foreach)")


def test_offloading_a_fused_adamw_predicts_its_fused_host_step():
    """offload.recommended's step after the offload counts the optimizer on the host in the implementation the
    user's optimizer would take there: the H100 row gpu_gpt_offload_needed (9.73 M elements a rank, its state 148 MiB
    of a peak at 97% of its budget) read as built now, AdamW fused: its host step predicted from the loop's 8 ns an
    element scaled by the table's fused/loop ratio, about 20 ms where the loop's figure is 78 ms."""
    from fsdp_doctor.diagnose.estimate import cpu_step_ratio
    from fsdp_doctor.diagnose.rules.offload import CPU_OPTIMIZER_NS_PER_ELEMENT

    run = recorded_as_torch_holds_it("gpu_gpt_offload_needed")
    for rd in run.ranks.values():
        for g in rd.config.optimizer_groups:
            g.flags = {"foreach": False, "fused": True}
    _, found, _ = _diagnose(run)
    f = found["offload.recommended"]
    elements, tensors = 9_728_000, sum(g.params for g in run.ranks[0].config.optimizer_groups)
    loop = elements * CPU_OPTIMIZER_NS_PER_ELEMENT["AdamW"] / 1e6
    want = loop * cpu_step_ratio("fused", "for-loop", elements, tensors)
    assert f.evidence["cpu_optimizer_ms_per_step_est"] == pytest.approx(want, rel=0.01), (f.evidence, want, loop)
    assert "AdamW steps on the CPU (fused), about 20 ms" in f.recommendation.text, f.recommendation.text
    ev = f.evidence
    assert f.predicted.step_ms_after == pytest.approx(ev["step_p50_ms"] + ev["copy_ms_per_step_est"] + want
                                                      - ev["optimizer_ms_per_step"], abs=0.01)


def test_low_mfu_reads_the_offloaded_optimizer_as_host_time_of_its_own():
    """The same H100 row's trace reads 98.3 ms of its 170 ms step as the device waiting for the host; 86.4 ms of it
    is the offloaded AdamW stepping on the CPU, which torch.compile and CUDA graphs (the launch-overhead lever,
    named first before) cannot recover: throughput.low_mfu names that lever first, and its fixes' rules."""
    _, found, statuses = _diagnose(recorded_as_torch_holds_it("gpu_gpt_offload"))
    # (and the host-bound verdict counts the host's optimizer among its levers)
    assert "optim.unfused_step" in statuses["verdict.severe"].reason, statuses["verdict.severe"]
    f = found["throughput.low_mfu"]
    ev = f.evidence
    assert ev["lever_order"][:2] == ["optimizer on the host", "host overhead"], ev["lever_order"]
    assert ev["recoverable_ms"]["optimizer on the host"] == pytest.approx(86.4, abs=0.1), ev
    assert ev["recoverable_ms"]["host overhead"] < 15, ev
    assert "optim.unfused_step" in f.recommendation.text and "offload.costly" in f.recommendation.text
    assert "torch.compile" not in f.recommendation.text.split("Fix:")[1], f.recommendation.text


def test_the_elements_stepped_are_the_optimizers_own(tmp_path, gloo_one_rank):
    """An optimizer over the last block only steps that block's 65,792 elements, not the 8 blocks' 526,336: the
    elements the step's cost is modelled on (and offload.recommended's host step) leave out the parameters it does
    not hold (RunConfig.untrained's split per unit)."""
    import fsdp_doctor
    from fsdp_doctor.diagnose import estimate as E
    from fsdp_doctor.diagnose.base import Context

    run, _ = _run(tmp_path / "top", opt=lambda ps, lr: torch.optim.AdamW(list(ps)[-2:], lr=lr))
    ctx = Context(run, fsdp_doctor.build_report(run))
    assert E.optimizer_shard_elements(ctx, E.param_units(ctx)) == 256 * 256 + 256
    assert sum(g.params for g in ctx.config.optimizer_groups) == 2
