"""Tokens/s, achieved TFLOP/s, MFU and HFU from the recorded step times and the counted FLOPs.

MFU counts model FLOPs (forward, backward, optimizer), HFU hardware FLOPs (model FLOPs plus activation
checkpointing's recompute, counted only: the analytic estimate has none); the rules judge MFU.

Where FLOPs were not counted (counting failed, or was off) but tokens per step are known, the FLOPs come
from the analytic estimate 6 x parameters x tokens per rank (Kaplan et al. 2020: forward 2, backward 4 FLOPs
per parameter per token; attention scores not included, so it reads low for long sequences; a mixture of
experts' routed experts counted top_k of num_experts), and each row says which (``flops_source``: ``"counted"`` or
``"analytic"``; ``flops_note``: which parameters the estimate counts).

FLOPs are counted on one step. Where the steps' batches differ in size (``StepRecord.input_elements``: variable
sequence lengths, token budgets, bucketing), each step's FLOPs are the counted ones scaled by its batch's elements
over the counted step's, and the rate is their sum over the steps' summed time: a count of a 4-row step read as every
step's put MFU 40x low on steps of 64 and 256 rows. Linear in the batch: exact where the rows vary, low where the
sequences lengthen under attention (its quadratic term is not scaled); the row's note says so."""

from __future__ import annotations

from ..records import Experts
from ..report_sections import ThroughputJob, ThroughputRank, ThroughputSection
from ..store import Run
from .steps import step_stats, usable_steps


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant figures: TFLOP/s of a GPU (hundreds) and of a CPU run (thousandths) alike."""
    return float(f"{x:.{digits}g}")


def analytic_flops_per_step(cfg) -> float | None:
    """6 x parameters x this rank's tokens per step, or None without tokens or parameters. With frozen parameters
    (fine-tuning) the backward's 4 are 2 for the input gradients, over the parameters from the first trainable one
    on, and 2 for the weight gradients, over the trainable ones: 6 x N counted 63% over what an HF Llama with LoRA
    adapters ran (the counted step: its backward is 0.96x its forward, 2x when every parameter trains). A mixture
    of experts' routed experts count as a token runs them, top_k of num_experts (``RunConfig.experts``)."""
    return _analytic(cfg)[0]


def _analytic(cfg, tokens: float | None = None) -> tuple[float | None, str]:
    """The analytic FLOPs of one step on this rank, and a sentence saying which parameters they count; ``tokens``:
    this rank's tokens a step (the loop's, doctor.step(tokens=N)), else watch()'s tokens_per_step over the ranks."""
    if tokens is None and cfg.tokens_per_step:
        tokens = cfg.tokens_per_step / max(1, cfg.world_size)
    if not tokens or not cfg.model_param_count:
        return None, ""
    ex = getattr(cfg, "experts", None) or Experts(param_count=0)
    idle = 1.0 - ex.share()  # of each expert parameter, the share a token does not run
    n = cfg.model_param_count - idle * ex.param_count
    trainable = getattr(cfg, "model_trainable_param_count", None)
    path = getattr(cfg, "model_grad_path_param_count", None)
    per_token, how = 6.0 * n, f"6 x {n / 1e6:.3g} M parameters x tokens"
    if trainable is not None and path is not None:
        path, trainable = path - idle * ex.grad_path_param_count, trainable - idle * ex.trainable_param_count
        per_token = 2.0 * n + 2.0 * path + 2.0 * trainable
        if not n == path == trainable:
            how = (f"(2 x {n / 1e6:.3g} M parameters + 2 x {path / 1e6:.3g} M from the first trainable one on "
                   f"+ 2 x {trainable / 1e6:.3g} M trainable) x tokens")
    note = f"FLOPs not counted: the analytic estimate, {how} per rank"
    if ex.param_count and idle:
        note += (f"; a mixture of experts: its {ex.param_count / 1e6:.3g} M expert parameters counted at top_k "
                 f"{ex.top_k} of {ex.num_experts} ({n / 1e6:.3g} M active of {cfg.model_param_count / 1e6:.3g} M)")
    elif ex.param_count:
        note += (f"; a mixture of experts whose top_k could not be read: every expert's {ex.param_count / 1e6:.3g} M "
                 "parameters counted, high by up to num_experts / top_k on them")
    return per_token * tokens, note


def _scaled(cfg, steps) -> tuple[float, float, str] | None:
    """(the steps' mean counted FLOPs scaled by their batches, those FLOPs per second, the note saying so), or None
    where every step's batch is the counted one's (or a batch is unknown)."""
    base = getattr(cfg, "flops_input_elements", None)
    sizes = [getattr(s, "input_elements", None) for s in steps]
    if not base or not sizes or not all(sizes) or all(n == base for n in sizes):
        return None
    flops = [cfg.flops_per_step * n / base for n in sizes]
    seconds = sum(s.wall_ms for s in steps) / 1e3
    if seconds <= 0:
        return None
    # (one sentence for every rank: the terminal prints each different note once)
    note = ("FLOPs counted on one step and scaled by each step's input elements, which vary: taken as linear in the "
            "batch (attention's quadratic term in the sequence length is not scaled)")
    return sum(flops) / len(flops), sum(flops) / seconds, note


def analyze_throughput(run: Run) -> ThroughputSection | None:
    """Per rank and for the job, or None where neither tokens per step nor FLOPs are known."""
    per_rank: dict[str, ThroughputRank] = {}
    tokens_sums: dict[str, tuple[int, float]] = {}  # rank -> (doctor.step(tokens=N) summed, its steps' seconds)
    job_flops = job_hw_flops = 0.0  # every rank's FLOPs per step, summed
    step_s: dict[str, float] = {}  # rank -> the seconds per step its FLOP rate is over
    any_data = False
    for r, rd in sorted(run.ranks.items()):
        cfg = rd.config
        steps = usable_steps(rd.steps)
        st = step_stats(steps)
        if cfg is None or not st.count:
            continue
        p50_s = st.p50_ms / 1e3
        row = ThroughputRank(step_p50_ms=st.p50_ms)
        # the loop's own count (doctor.step(tokens=N)) on every step: tokens/s over the steps' summed time
        given = [s.tokens for s in steps]
        seconds = sum(s.wall_ms for s in steps) / 1e3
        counted = bool(given) and None not in given and seconds > 0
        if counted:
            row.tokens_per_s = round(sum(given) / seconds, 1)
            tokens_sums[str(r)] = (sum(given), seconds)
            any_data = True
        elif cfg.tokens_per_step:
            row.tokens_per_s = round(cfg.tokens_per_step / cfg.world_size / p50_s, 1)
            any_data = True
        flops, source, note = cfg.flops_per_step, "counted", None
        if not flops:
            (flops, note), source = _analytic(cfg, sum(given) / len(given) if counted else None), "analytic"
        scaled = _scaled(cfg, steps) if source == "counted" and flops else None
        if source == "analytic" and flops and counted:  # each step's tokens: their FLOPs over the steps' time
            scaled = (flops, flops * len(given) / seconds, note + "; tokens from doctor.step(tokens=...), step by step")
        if flops:
            hw = cfg.hardware_flops_per_step if source == "counted" else None
            tf = flops / p50_s / 1e12
            hw_tf = hw / p50_s / 1e12 if hw else None
            if scaled is not None:  # the batches vary: each step's FLOPs over the steps' time (the recompute's alike)
                share = scaled[0] / flops
                flops, tf, note = scaled[0], scaled[1] / 1e12, scaled[2]
                if cfg.tokens_per_step and not counted:  # (a number the user gave once, for every step)
                    note += "; tokens/s takes watch()'s tokens_per_step as every step's"
                hw, hw_tf = (hw * share, tf * hw / cfg.flops_per_step) if hw else (None, None)
            row.flops_per_step = flops
            row.flops_source = source
            row.flops_note = note
            row.achieved_tflops = _sig(tf)
            step_s[str(r)] = flops / (tf * 1e12)
            job_flops += flops
            any_data = True
            if hw:
                row.hardware_flops_per_step = hw
                job_hw_flops += hw
            if cfg.peak_tflops:
                row.peak_tflops = cfg.peak_tflops
                row.mfu_pct = round(100 * tf / cfg.peak_tflops, 2)
                if hw:
                    row.hfu_pct = round(100 * hw_tf / cfg.peak_tflops, 2)
        per_rank[str(r)] = row
    if not any_data:
        return None
    cfg = run.config
    job = ThroughputJob()
    p50s = [v.step_p50_ms for v in per_rank.values()]
    if tokens_sums and len(tokens_sums) == len(per_rank):  # every rank's tokens over the slowest rank's time
        job.paced_by = max(tokens_sums, key=lambda r: tokens_sums[r][1])
        job.tokens_per_s = round(sum(t for t, _ in tokens_sums.values()) / tokens_sums[job.paced_by][1], 1)
    elif cfg and cfg.tokens_per_step and p50s:
        job.paced_by = max(per_rank, key=lambda r: per_rank[r].step_p50_ms)
        job.tokens_per_s = round(cfg.tokens_per_step / (max(p50s) / 1e3), 1)  # the slowest rank paces the job
    if step_s:
        # every rank's FLOPs per step over the pacing rank's step, as tokens/s (a new-user trial's job read 0.00147
        # TFLOP/s, the sum of its ranks' own rates 0.00061 and 0.000862, beside tokens/s paced by rank 0's 177.9 ms
        # step: 217 MFLOP / 177.9 ms = 0.00122)
        pace = job.paced_by if job.paced_by in step_s else max(step_s, key=lambda r: step_s[r])
        job.paced_by = pace
        job_tflops = job_flops / step_s[pace] / 1e12
        job.achieved_tflops = _sig(job_tflops)
        peaks = [v.peak_tflops for v in per_rank.values()]
        if all(peaks):
            job.mfu_pct = round(100 * job_tflops / sum(peaks), 2)
            if all(v.hfu_pct is not None for v in per_rank.values()):
                job.hfu_pct = round(100 * job_hw_flops / step_s[pace] / 1e12 / sum(peaks), 2)
    return ThroughputSection(per_rank=per_rank, job=job)
