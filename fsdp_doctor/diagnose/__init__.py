"""Diagnose: rules over the analyses, each finding with evidence, a fix and its predicted gain."""

from __future__ import annotations

import logging

from .base import NEEDS, RULES, SEVERITIES, Context, Finding, Need, Rule, register
from . import estimate as E
from . import snippets as S
from . import rules as _rules  # noqa: F401  (registers the rules)
from .code_width import fit
from ..report_sections import FIX_LANGUAGES, RuleStatus

log = logging.getLogger("fsdp_doctor")
# a quiet rule that did not say why (every rule says: tests/test_rules_catalogue.py checks it on real runs)
NO_REASON = "quiet: the rule gave no reason"


def diagnose(run, report, skipped: list[str] | None = None,
             statuses: list[RuleStatus] | None = None) -> list[Finding]:
    """Runs every registered rule over the run and its ``Report`` (or the report's JSON form), most severe
    findings first. A rule whose declared needs (``Rule.needs``) this run does not meet is not run. Every rule
    checked gets a ``RuleStatus`` in ``statuses`` (fired, quiet, skipped or failed, with the reason). A rule
    that fails is logged once and named in ``skipped`` ("not checked"; the pipeline lists them under the
    report's problems): never a crash and never a silent omission. So is a rule that would read a unit figure
    this torch did not let the recorder read."""
    skipped = [] if skipped is None else skipped
    statuses = [] if statuses is None else statuses
    ctx = Context(run=run, report=report)
    out: list[Finding] = []
    unknown = _unknown_unit_fields(run)
    for cls in sorted(RULES, key=lambda c: c.last):  # stable: registration order, the last-running ones after
        ctx.earlier = out
        missing = _missing(cls, ctx)
        if missing:
            statuses.append(cls.status("skipped", "; ".join(missing)))
            continue
        needs = [f for prefix, fields in _NEEDS for f in fields if cls.code.startswith(prefix) and f in unknown]
        if needs:  # the rule would read a figure this torch did not let us record: quiet, with the reason
            skipped.append(
                f"{cls.code} not checked: unit {', '.join(sorted(set(needs)))} unknown on this torch")
            statuses.append(cls.status("skipped", skipped[-1].split(": ", 1)[1]))
            continue
        rule = cls()
        rule.config = ctx.config
        try:
            found = rule.match(ctx)
        except Exception as e:  # noqa: BLE001
            log.warning("fsdp_doctor: rule %s failed (%s: %s)", cls.code, type(e).__name__, e)
            # never a silent "healthy": the report lists the rule that could not run
            skipped.append(
                f"{cls.code} not checked: the rule failed ({type(e).__name__}: {e})")
            statuses.append(cls.status("failed", f"{type(e).__name__}: {e}"))
            continue
        out.extend(found)
        if found:
            statuses.append(cls.status("fired", "; ".join(f.title for f in found), len(found)))
        else:
            statuses.append(cls.status("skipped" if rule.unchecked else "quiet", rule.why_quiet or NO_REASON))
    if (root := S.root_expr(S.tree(ctx))) != S.ROOT:  # the watched model holds the root unit (a LightningModule)
        for f in out:
            S.on_root_unit(f.recommendation, root)
    if E.transformers_sharded(ctx):  # its fixes where a user of transformers' own sharding can put them
        for f in out:
            S.for_transformers(f.recommendation)
    if E.trainer_driven(ctx):  # its fixes where a Trainer's user can put them
        for f in out:
            S.for_trainer(f.recommendation, f.code, E.on_gpu(ctx))
    if (accumulate := E.lightning_accumulate(ctx)) is not None:  # ... and into a LightningModule's training_step
        for f in out:
            S.for_lightning(f.recommendation, accumulate, root_known=ctx.config is not None)
    if E.titan_trainer_driven(ctx):  # ... and where a user of torchtitan's own Trainer can
        for f in out:
            S.for_titan_trainer(f.recommendation, f.code, E.torchtitan_version(ctx) or "")
    if E.olmo_driven(ctx):  # ... and where a user of OLMo-core's Trainer can: its configs, its built train module
        for f in out:
            S.for_olmo(f.recommendation, f.code, getattr(ctx.config, "optimizer", None) or "", S.tree(ctx))
    if (recipe := E.torchtune_recipe(ctx)) is not None:  # ... and into a torchtune recipe's copy
        for f in out:
            S.for_torchtune(f.recommendation, recipe)
    for f in out:  # every Python fix in 80 columns, whatever indented it last (code_width)
        if f.recommendation.code and f.recommendation.where not in FIX_LANGUAGES:
            f.recommendation.code = fit(f.recommendation.code)
    return sort_findings(out)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first; within a severity the largest predicted gain first (a straggler's "51% faster" was listed
    after a "2% faster", by code: a new-user trial), then by code."""
    order = {s: i for i, s in enumerate(reversed(SEVERITIES))}
    return sorted(findings, key=lambda f: (order[f.severity], -_gain(f.predicted), f.code))


def _gain(p) -> float:
    """A prediction's larger relative gain, of the step or of the peak (0 for none or a loss)."""
    if not p:
        return 0.0
    shares = [(b - a) / b for b, a in ((p.step_ms_before, p.step_ms_after), (p.peak_bytes_before, p.peak_bytes_after))
              if b and a is not None]
    return max([0.0, *shares])


def _missing(cls: type[Rule], ctx: Context) -> list[str]:
    """The reasons ``cls`` cannot run on this run (its unmet needs), [] when it can."""
    return [NEEDS[n].reason(ctx) for n in cls.needs if not NEEDS[n].met(ctx)]


def catalogue() -> list[dict]:
    """Every registered rule: code, severities, needs (keys of ``NEEDS``), name and what it checks; the source
    of ``fsdp-doctor rules`` and of the README's rule table."""
    return [{"code": c.code, "severity": "/".join(c.severities), "needs": list(c.needs),
             "name": c.name, "checks": c.description} for c in sorted(RULES, key=lambda c: c.code)]


# unit fields (UnitConfig) each family of rules reads; a None there ("unknown") keeps the rule quiet
_SIZES = ("param_count", "sharded_bytes", "unsharded_bytes")
_NEEDS = (("wrap.", _SIZES), ("reshard.", _SIZES + ("reshard_after_forward",)), ("ac.", _SIZES),
          ("offload.", _SIZES), ("prefetch.", _SIZES + ("reshard_after_forward", "forward_prefetch")),
          ("prefetch.sync_unshard", ("unshard_async_op",)), ("optim.state_dominates", _SIZES))


def _unknown_unit_fields(run) -> set[str]:
    cfg = getattr(run, "config", None)
    fields = {f for _, fs in _NEEDS for f in fs}
    return {f for u in (cfg.units if cfg is not None else []) for f in fields if getattr(u, f, 0) is None}


__all__ = ["Context", "Finding", "NEEDS", "Need", "RULES", "Rule", "SEVERITIES", "catalogue", "diagnose", "register"]
