"""The comparison's contract: msgspec structs built by :func:`fsdp_doctor.analyze.compare.compare` from two
reports (and their per-step samples) and read by every presenter of ``fsdp-doctor compare`` (terminal, JSON,
HTML, the dashboard's Compare page). ``--json`` writes ``msgspec.to_builtins(comparison)``.

Deltas are B − A; ``pct`` is relative to A. Times in ms, memory in bytes, unless a field's name says otherwise.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

SCHEMA = "fsdp-doctor-compare/1"


class _S(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class Delta(_S):
    """One figure in both runs: ``a``, ``b``, ``delta`` (b − a) and ``pct`` (of a); None where a side lacks it."""

    a: Optional[float] = None
    b: Optional[float] = None
    delta: Optional[float] = None
    pct: Optional[float] = None


class StepDelta(Delta):
    """A step-time percentile in both runs, with the bootstrap confidence interval of its change (ms): the
    per-step samples resampled by step (every rank's time of a step kept together), seeded."""

    ci_low: Optional[float] = None
    ci_high: Optional[float] = None
    confidence: float = 0.95
    # the interval excludes zero, the change exceeds the noise floor, and the runs differ in configuration (or
    # --applied names a fix B applies): the interval covers each run's step-to-step noise, not the variation between
    # two runs (host load, clocks), so without a change a difference is the host's, not an effect
    significant: bool = False
    # why not significant: "within noise" | "under noise floor" | "no config change" | "too few steps" | ...
    reason: str = ""
    samples_a: int = 0  # rank-steps sampled (steps × ranks)
    samples_b: int = 0
    steps_a: int = 0  # steps resampled (each with every rank's time)
    steps_b: int = 0


class RunSide(_S):
    path: str
    source: str  # "records" | "trace" (a plain-trace folder)
    world_size: Optional[int] = None
    steps: int = 0  # steps in the samples
    unfinished: list[str] = []  # ranks whose run did not finish (killed, still going, or stopped on an exception)
    problems: list[str] = []  # what this side's report skipped, one line each ("file: why"), as analyze names it


class ConfigChange(_S):
    """One configuration difference: ``scope`` "job" or the units it applies to (identical changes grouped)."""

    key: str  # wrapping, reshard_after_forward, forward_prefetch, ..., world_size, torch_version, tokens_per_step,
    # trainable (the requires_grad share of the units' gathered parameter bytes, or of the model's parameters: "73.5%"),
    # gradient_sync (gradient accumulation's micro-batches that reduce-scatter: "every micro-batch (4 of 4)")
    a: Any = None
    b: Any = None
    units: list[str] = []  # the units it applies to (empty: the job)


class CommDelta(_S):
    """Exposed communication of one unit, collective and phase (ms per step)."""

    unit: str
    collective: str
    phase: Optional[str] = None
    a_ms: Optional[float] = None
    b_ms: Optional[float] = None
    delta_ms: Optional[float] = None  # a side without the row counts as 0 ms
    pct: Optional[float] = None  # of A's (None where A has no such row, or 0 ms)


class FindingRef(_S):
    code: str
    severity: str
    title: str
    why: str = ""  # unchecked: why B's report could not check it (its rule's reason); below_threshold: that it fell
    # below its threshold, no change of its fix found


class FindingsDiff(_S):
    resolved: list[FindingRef] = []  # in A, not in B, whose rule B's report checked
    # in A, not in B, whose rule B's report checked, where every setting its fix changes was read on both sides and
    # none changed (nor --applied names it): it fell below its threshold in B, no fix made
    below_threshold: list[FindingRef] = []
    unchecked: list[FindingRef] = []  # in A; B's report could not check its rule (skipped: an input it needs)
    new: list[FindingRef] = []  # in B, not in A
    persisting: list[FindingRef] = []  # in both (B's wording)


class PredictionCheck(_S):
    """A fix A's report recommended that B applies: what A's finding predicted against what B measured."""

    code: str
    recognised_by: str  # "config diff: reshard_after_forward" | "--applied"
    step_ms_predicted: Optional[float] = None  # A's step with the predicted change applied
    step_ms_measured: Optional[float] = None  # B's
    step_pct_predicted: Optional[float] = None
    step_pct_measured: Optional[float] = None
    # "held" | "missed" | "inconclusive" (the measured interval holds both the predicted change and none: these
    # runs cannot tell them apart); None: no step prediction
    step_verdict: Optional[str] = None
    peak_bytes_predicted: Optional[int] = None
    peak_bytes_measured: Optional[int] = None
    peak_pct_error: Optional[float] = None  # (predicted - measured) / measured
    peak_held: Optional[bool] = None
    # the other fixes B applies whose predicted peak changes peak_bytes_predicted adds to this one's (a loop fix B
    # resolved, a fix of other settings): two fixes pasted into one rerun move the peak together
    peak_with: list[str] = []
    # a fix whose gain lies in steps the step statistics leave out (checkpoint.blocking: the saves' share of the
    # recorded time, %): A's prediction against B's share, held when B's fell by at least half the predicted drop
    share_pct_before: Optional[float] = None
    share_pct_predicted: Optional[float] = None  # None for async_save (the rule prices none: at most all of it)
    share_pct_measured: Optional[float] = None
    share_held: Optional[bool] = None  # None: not checked (share_why says why)
    # which of the fix's alternatives B took, by its own records (checkpoint.blocking: its saves asynchronous where
    # A's were not, or fewer: a longer interval): "async_save" | "less often" (both checked) | "both" | "neither" |
    # "no save" (not checked)
    share_fix: str = ""
    share_why: str = ""  # what B did, where nothing was checked; async_save's: how many of B's saves were
    share_every_a: Optional[float] = None  # steps between saves in A (median; with one save, the steps counted)
    share_every_b: Optional[float] = None  # ... in B: a less-often prediction is checked at B's interval
    share_every_advised: Optional[int] = None  # the interval A's finding advised (its save_steps_after)
    share_saves_b: Optional[int] = None  # less often: B's saves counted, with which A's saves are predicted
    # async_save: A's saves' time per step (the most it gains, less the copy to host memory) and A's less B's
    gain_ms_per_step_at_most: Optional[float] = None
    gain_ms_per_step_measured: Optional[float] = None


class OpChange(_S):
    """A kernel's or operator's time in one phase (µs per step and rank; operators: self time)."""

    phase: str
    kind: str  # "kernel" | "operator"
    name: str
    a_us: float = 0.0
    b_us: float = 0.0
    delta_us: float = 0.0


class Cost(_S):
    """Cost per billion tokens at ``gpu_hour_price`` per GPU-hour, every rank one GPU."""

    gpu_hour_price: float
    a: Optional[float] = None
    b: Optional[float] = None
    delta: Optional[float] = None
    pct: Optional[float] = None
    note: str = ""  # why a side is missing


class Comparison(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="schema", tag=SCHEMA):
    # (its schema, SCHEMA, is its tag: written first, always; as a field equal to its default it was omitted, and a
    # compare --json had no schema at all)
    a: RunSide
    b: RunSide
    summary: str = ""  # one line: the step-time verdict
    config: list[ConfigChange] = []
    step_p50: Optional[StepDelta] = None
    step_p90: Optional[StepDelta] = None
    phases: dict[str, Delta] = {}  # phase -> ms per step (records: median; traces: the breakdown's parts)
    phases_source: str = ""  # "records" | "trace"
    memory_peak: Optional[Delta] = None  # bytes, highest rank
    memory: dict[str, Delta] = {}  # category -> bytes at each run's peak
    comm_exposed: Optional[Delta] = None  # the report's headline (ms per step)
    comm: list[CommDelta] = []  # largest change first, then most exposed (the first TOP_COMM)
    comm_rows: int = 0  # the rows there were (comm holds the first TOP_COMM of them)
    comm_source: str = ""  # "trace" | "records"
    throughput: dict[str, Delta] = {}  # tokens_per_s, achieved_tflops, mfu_pct
    findings: FindingsDiff = msgspec.field(default_factory=FindingsDiff)
    predictions: list[PredictionCheck] = []
    ops: list[OpChange] = []  # from both sides' traces: the largest changes, per phase
    cost: Optional[Cost] = None
    notes: list[str] = []

    def to_builtins(self) -> dict:
        return msgspec.to_builtins(self)
