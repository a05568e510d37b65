"""Findings and the rule shape (after torch.profiler's ``_pattern_matcher.Pattern``: name, description, what it
needs (``skip``), match, report). A rule is a small class over plain typed data: the Run and the report's
sections. It declares ``needs`` (keys of ``NEEDS``): where one is not met the rule is not run and the report
says so (``skipped`` with the need's reason); a rule that ran and found nothing is ``quiet`` with the reason it
gave (``self.quiet(why)``) or, without one, what it checks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, ClassVar, NamedTuple, Optional

from ..records import (ACCELERATE_SHARDER, TITAN_DRIVER, TORCHTITAN_SHARDER, TRAINER_DRIVER, optimizer_model_params,
                       optimizer_of_another_model)
from ..report_sections import FIX_LANGUAGES, FIX_PLACES, Finding, Recommendation, Report, RuleStatus
from ..store import Run
from ..store.reader import window_words
from ..units import fit_comments
from .snippets import (FSDP_MESH_USE, PLUGIN_CALLS, PLUGIN_INPUTS, PREPARED_INPUTS, SHARD_PLACEMENT_FN, TITAN_CALLS,
                       calls_words, complete, fix_place, for_prepared_optimizer, mesh_input, model_parallel,
                       placement_input)

SEVERITIES = ("info", "warning", "critical")


@dataclass
class Context:
    """What every rule may look at: the run (configs, raw steps) and the report's sections already computed,
    by attribute (``ctx.report.steps``, ``.units``, ``.memory``, ``.overlap``, ``.throughput``, ``.verdict``,
    ``.comm``: None where nothing fed the section). A report's JSON form is read into a ``Report``."""

    run: Run
    report: Report
    # the other rules' findings, for a rule that runs last (``Rule.last``): whether a severe verdict already
    # has findings that name its levers
    earlier: list[Finding] = field(default_factory=list)
    # figures several rules read, computed once per diagnosis (estimate.py's ``_once``): over every step record, a
    # second a read on a 20,000-step run
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.report = Report.of(self.report)

    @property
    def config(self):
        return getattr(self.run, "config", None)


# ------------------------------------------------------------------------------------------------ needs
class Need(NamedTuple):
    """What a rule needs: ``text`` for the catalogue, ``met(ctx)`` whether this run has it, ``missing`` the
    reason the rule was skipped without it, and ``why(ctx)`` what this run says of it (appended, when it says)."""

    text: str
    met: Callable[[Context], bool]
    missing: str
    why: Optional[Callable[[Context], Optional[str]]] = None

    def reason(self, ctx: Context) -> str:
        more = self.why(ctx) if self.why is not None else None
        return f"{self.missing}: {more}" if more else self.missing


def _world_size(ctx: Context) -> int:
    cfg = ctx.config
    if cfg is not None and cfg.world_size:
        return int(cfg.world_size)
    ws = ctx.report.run.world_size
    ranks = set(getattr(ctx.run, "ranks", None) or {}) | set((ctx.report.overlap.per_rank
                                                              if ctx.report.overlap is not None else {}))
    return max(int(ws or 0), len(ranks))


def trace_device(ctx: Context) -> Optional[str]:
    """"gpu" where any rank's trace ran on a GPU, "cpu" for CPU-only traces, None without a trace."""
    per_rank = ctx.report.overlap.per_rank if ctx.report.overlap is not None else {}
    devs = {pr.device for pr in per_rank.values()}
    return "gpu" if "gpu" in devs else ("cpu" if devs else None)


def _no_window(ctx: Context) -> Optional[str]:
    """Why a recorded run has no profiler trace, where its window's trace was not saved (a full disk), its steps
    ended before the doctor's first window, or its windows met evaluation steps and were dropped unsaved."""
    sched = getattr(ctx.config, "profile_schedule", None)
    ranks = getattr(ctx.run, "ranks", None) or {}
    if (window := getattr(ctx.run, "steps_window", None)) is not None and sched and \
            not any(rd.profiles for rd in ranks.values()):
        # (its 3 steps read "ended before the doctor's first profiler window" under analyze --steps 9-)
        return (f"no profiler window lies inside the steps analysed ({window_words(window)}): analyse steps holding "
                "one, or watch(..., profile=fsdp_doctor.ProfileSchedule(first=N)) puts one at step N")
    lost = next((pw for rd in ranks.values() for pw in rd.lost_profiles), None)
    if lost is not None and not any(rd.profiles for rd in ranks.values()):  # (--explain said "this run has none" of
        # a run whose one window a full disk lost: a new-user trial)
        steps = lost.steps
        where = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "its window"
        return f"its profiler window at {where} was not saved ({lost.lost})"
    steps = max((len(rd.steps) for rd in ranks.values()), default=0)
    if sched and steps > sched.get("first", 0) and not any(rd.profiles for rd in ranks.values()):
        return _windows_dropped(ranks, int(sched.get("active", 1)))
    if not sched or not steps or steps > sched.get("first", 0):
        return None
    first, active = int(sched["first"]), int(sched.get("active", 1))
    earlier = (f"watch(..., profile=fsdp_doctor.ProfileSchedule(first={steps - active})) records one in its last "
               f"{active} steps" if steps - active >= 1 else f"a run of {active + 1} steps or more records one")
    window = f"steps {first}-{first + active - 1}" if active > 1 else f"step {first}"
    return f"its {steps} steps ended before the doctor's first profiler window ({window}); {earlier}"


def _windows_dropped(ranks: dict, active: int) -> Optional[str]:
    """Why no window was saved where the doctor's windows met steps that also ran the model without gradients: each is
    dropped unsaved and taken again, twice at most (a new-user trial's Trainer evaluating every 2 steps of 9 saved
    none, and the report said only that the run had no trace), with a window the steps without evaluation hold."""
    rd = next(iter(ranks.values()), None)
    if rd is None:
        return None
    evaluated = sorted(s.step for s in rd.steps if s.no_grad_forwards)
    met = [n for n in evaluated if any(s.step == n and s.profiled for s in rd.steps)]
    if not met:
        return None
    free = {s.step for s in rd.steps if s.step >= 2 and not s.no_grad_forwards}  # (a warm-up step before each)
    # the first run of ``active`` steps without an evaluation, else of one
    start, width = next(((n, w) for w in (active, 1) for n in sorted(free)
                         if all(n + k in free for k in range(w))), (None, 1))
    fix = ("evaluating less often leaves a window steps without it" if start is None else
           f"watch(..., profile=fsdp_doctor.ProfileSchedule(first={start}, active={width})) records "
           + (f"steps {start}-{start + width - 1}, which do not evaluate" if width > 1 else
              f"step {start}, which does not evaluate"))
    shown = ", ".join(str(n) for n in met[:6]) + (", ..." if len(met) > 6 else "")
    return (f"the doctor's profiler windows met steps that also ran the model without gradients (step"
            f"{'s' * (len(met) > 1)} {shown}: an evaluation) and were dropped unsaved, as a window would read the "
            "evaluation as the step's; " + fix)


def _sharded(ctx: Context) -> bool:
    """The parameters are sharded over two or more ranks, or nothing says otherwise (a plain trace without its world
    size is not taken as one rank). One rank, or the shard dimension of a 2x1 HSDP mesh (every unit's shard group
    one rank): its all-gathers are local copies."""
    cfg = ctx.config
    if cfg is not None and cfg.world_size == 1:
        return False
    rows = ctx.report.units or (cfg.units if cfg is not None else [])
    sizes = [u.shard_size for u in rows if getattr(u, "shard_size", None) is not None and u.param_count]
    return not sizes or max(sizes) > 1


def _on_gpu(ctx: Context) -> bool:
    cfg = ctx.config
    dev = (cfg.device if cfg is not None else "") or (ctx.report.run.device or "")
    return dev.startswith("cuda") or trace_device(ctx) == "gpu"


NEEDS: dict[str, Need] = {
    "records": Need("step records (fsdp_doctor.watch)", lambda ctx: _has_records(ctx),
                    "needs the doctor's step records (fsdp_doctor.watch); this run has none"),
    "trace": Need("a profiler trace",
                  lambda ctx: bool(ctx.report.overlap is not None and ctx.report.overlap.per_rank),
                  "needs a torch.profiler trace; this run has none", _no_window),
    "records|trace": Need("step records or a profiler trace",
                          lambda ctx: (_has_records(ctx) or bool(ctx.report.overlap is not None and ctx.report.overlap.per_rank)),
                          "needs step records or a profiler trace"),
    "units": Need("the FSDP unit snapshot",
                  lambda ctx: bool(ctx.report.units or (ctx.config is not None and ctx.config.units)),
                  "needs the FSDP unit snapshot (fsdp_doctor.watch records it)"),
    "units|trace": Need("the FSDP unit snapshot or a profiler trace",
                        lambda ctx: (NEEDS["units"].met(ctx) or NEEDS["trace"].met(ctx)),
                        "needs the FSDP unit snapshot (fsdp_doctor.watch records it) or a profiler trace"),
    "memory": Need("memory samples", lambda ctx: _has_memory(ctx),
                   "needs the recorder's memory samples; this run has none"),
    "gpu": Need("a GPU run or trace", _on_gpu, "needs a GPU run or GPU trace; this one ran on the CPU"),
    "gpu_trace": Need("a GPU profiler trace", lambda ctx: trace_device(ctx) == "gpu",
                      "needs a GPU profiler trace (kernels on their streams); this run has none, or a CPU one"),
    "multi_rank": Need("world size > 1", lambda ctx: _world_size(ctx) > 1,
                       "needs two or more ranks; this run has one"),
    "sharded": Need("parameters sharded over 2+ ranks", _sharded,
                    "needs parameters sharded over two or more ranks; each shard group here is one rank (one rank, "
                    "or a 2x1 HSDP mesh): its all-gathers are local copies, with nothing to wait for or hold"),
    "verdict": Need("a verdict (trace or records)", lambda ctx: ctx.report.verdict is not None,
                    "needs the verdict (what bounds the step), which this run could not give"),
    "throughput": Need("FLOP counts (MFU)", lambda ctx: bool(
        ctx.report.throughput is not None and any(r.mfu_pct is not None
                                                  for r in ctx.report.throughput.per_rank.values())),
                       "needs an MFU figure (FLOPs per step and the device's peak)"),
    # (an optimizer holding none of the model's parameters, another FSDP2 model's: a teacher watched with its student's
    # optimizer, whose rules would read the student's)
    "optimizer": Need("the optimizer (watch(model, optimizer))",
                      lambda ctx: bool(ctx.config is not None and ctx.config.optimizer and not (
                          ctx.config.optimizer_other_params and not optimizer_model_params(ctx.config))),
                      "needs the optimizer of the watched model passed to fsdp_doctor.watch",
                      lambda ctx: optimizer_of_another_model(ctx.config) if ctx.config is not None else None),
}


def _has_records(ctx: Context) -> bool:
    return bool(getattr(ctx.run, "has_records", False)) or ctx.config is not None or ctx.report.steps is not None


def _has_memory(ctx: Context) -> bool:
    mem = ctx.report.memory
    if mem is not None and mem.per_rank:
        return True
    return any(s.memory is not None for rd in (getattr(ctx.run, "ranks", None) or {}).values() for s in rd.steps)


# ------------------------------------------------------------------------------------------------ rules
class Rule:
    """One diagnosis rule. Subclasses set ``code``, ``name``, ``description`` (what it checks), ``needs`` (keys
    of ``NEEDS``) and ``severities`` (what its findings may be), and implement ``match``; a rule that finds
    nothing may say why with ``return self.quiet(why)``."""

    code: ClassVar[str] = ""
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()
    severities: ClassVar[tuple[str, ...]] = ("info", "warning")
    last: ClassVar[bool] = False  # runs after every other rule, reading their findings (``ctx.earlier``)

    why_quiet: str = ""
    unchecked: bool = False  # quiet because an input it needs is missing (:meth:`skip`): listed "skipped"
    # the run's RunConfig, set before match (diagnose): what a fix's completion reads (its FSDP mesh)
    config = None

    def match(self, ctx: Context) -> list[Finding]:
        raise NotImplementedError

    def quiet(self, why: str) -> list:
        """No finding, and why (the reason ``analyze --explain`` and the report's ``rules`` show)."""
        self.why_quiet = why
        return []

    def skip(self, why: str) -> list:
        """No finding because an input the check needs is missing (the memory capacity, a peak): the rule is listed
        "skipped" with ``why``, not "quiet" as if it had looked and found nothing."""
        self.unchecked = True
        return self.quiet(why)

    def finding(self, severity: str, title: str, evidence: dict, text: str, code: str = "", *,
                where: str = "", inputs: dict[str, str] | None = None, accumulated: bool = True,
                **kw) -> Finding:
        """``code``: the fix; ``where`` it goes (report_sections.FIX_PLACES; read from the code when not
        given); a loop fix's ``inputs``, the names it reads from the user's loop (a fix on accelerate's FSDP2 plugin,
        ``where`` "trainer" or "accelerate", reads the object holding it: snippets.PLUGIN_INPUTS). In a loop around
        accelerate's prepare() those names are what its accumulate() holds (snippets.PREPARED_INPUTS) unless
        ``accumulated`` is False: the run shows accumulate() not switching (the loop does not enter it)."""
        assert severity in SEVERITIES, severity
        where = where or fix_place(code)
        if where == "sharded" and prepared_by_user(self.config):  # no fully_shard calls of the user's own
            where = "prepared"
        elif where == "sharded" and parallelized_by_user(self.config):  # ... nor here
            where = "parallelized"
        assert where in FIX_PLACES or not code, (self.code, where)
        if where in ("prepared", "parallelized"):  # the fully_shard calls the fix's words name are not the user's
            code = calls_words(code, PLUGIN_CALLS if where == "prepared" else TITAN_CALLS)
        # the snippet with the imports and mesh it uses (diagnose/snippets.py): it runs pasted as it is
        inputs = inputs or dict(PLUGIN_INPUTS.get(where, {}))
        if prepared_by_user(self.config):  # the loop's names as accelerate's accumulate() holds them
            if accumulated:
                inputs = {k: PREPARED_INPUTS.get(k, v) for k, v in inputs.items()}
            code = for_prepared_optimizer(code)
        # a run whose parameters' mesh has model-parallel dims beside FSDP's: the mesh a fix uses is the user's FSDP
        # mesh, which the fix reads (a new mesh cannot be it: FSDP needs the tensor-parallel mesh's parent); so too
        # HSDP's 2-D mesh and a 1-D one over some of the ranks (snippets.partial_mesh)
        mesh = mesh_input(self.config)
        code = complete(code, define_mesh=not mesh, mesh_known=bool(getattr(self.config, "units", None)))
        if mesh and re.search(r"\bmesh\b(?!=)", code) and not re.search(r"^\s*mesh\s*=", code, re.M):
            name = "mesh"
            if model_parallel(self.config):
                # beside tensor parallelism the user's `mesh` is likely the whole mesh (torch's examples name it so):
                # pasted with `mesh=mesh`, a new-user trial's plan raised "Cannot concatenate overlapping meshes".
                # FSDP's part of it goes by dp_mesh (torch's tensor-parallel tutorial's and torchtitan's name)
                name = "dp_mesh"
                code = FSDP_MESH_USE.sub(name, code)
            inputs = {**inputs, name: mesh}
        if f"shard_placement_fn={SHARD_PLACEMENT_FN}" in code:  # the user's own, passed again by a plan
            inputs = {**inputs, SHARD_PLACEMENT_FN: placement_input(self.config)}
        # its comments within 80 columns as the report holds it: the JSON, the HTML and the dashboard show the code as
        # written (lines of 100 columns there, which only the terminal wrapped: a new-user trial); a command line as
        # it is
        if where not in FIX_LANGUAGES:
            code = fit_comments(code)
        rec = Recommendation(text=text, code=code, where=where if code else "", inputs=inputs)
        return Finding(code=self.code, severity=severity, title=title, evidence=evidence, recommendation=rec, **kw)

    @classmethod
    def status(cls, status: str, reason: str, findings: int = 0) -> RuleStatus:
        return RuleStatus(code=cls.code, status=status, reason=reason, findings=findings)


def prepared_by_user(config) -> bool:
    """accelerate's FSDP2 plugin sharded the model in the user's own ``accelerator.prepare`` (not a Trainer's): a
    fix for the sharded model goes after that call, where the user has no fully_shard calls."""
    return (getattr(config, "sharded_by", None) == ACCELERATE_SHARDER
            and getattr(config, "driver", None) != TRAINER_DRIVER)


def parallelized_by_user(config) -> bool:
    """torchtitan's parallelize function sharded the model in the user's own loop (not torchtitan's Trainer, whose
    fixes go in its config: snippets.for_titan_trainer): a fix for the sharded model goes after that call."""
    return (getattr(config, "sharded_by", None) == TORCHTITAN_SHARDER
            and getattr(config, "driver", None) != TITAN_DRIVER)


RULES: list[type[Rule]] = []


def register(cls: type[Rule]) -> type[Rule]:
    assert cls.code and cls.code not in {r.code for r in RULES}, cls.code
    assert all(n in NEEDS for n in cls.needs), (cls.code, cls.needs)
    assert cls.severities and all(s in SEVERITIES for s in cls.severities), (cls.code, cls.severities)
    RULES.append(cls)
    return cls
