"""Diagnose: rules over the analyses, each finding with evidence, a fix and its predicted gain."""

from __future__ import annotations

import logging

from .base import RULES, SEVERITIES, Context, Finding, Rule, register
from . import rules as _rules  # noqa: F401  (registers the rules)

log = logging.getLogger("fsdp_doctor")


def diagnose(run, report: dict) -> list[dict]:
    """Runs every registered rule; a rule that fails is logged once and listed under the report's problems
    ("not checked"), never a crash and never a silent omission."""
    ctx = Context(run=run, report=report)
    out: list[Finding] = []
    unknown = _unknown_unit_fields(run)
    for cls in RULES:
        needs = [f for prefix, fields in _NEEDS for f in fields if cls.code.startswith(prefix) and f in unknown]
        if needs:  # the rule would read a figure this torch did not let us record: quiet, with the reason
            report.setdefault("rules_skipped", []).append(
                f"{cls.code} not checked: unit {', '.join(sorted(set(needs)))} unknown on this torch")
            continue
        try:
            out.extend(cls().match(ctx))
        except Exception as e:  # noqa: BLE001
            log.warning("fsdp_doctor: rule %s failed (%s: %s)", cls.code, type(e).__name__, e)
            # never a silent "healthy": the report lists the rule that could not run
            report.setdefault("rules_skipped", []).append(
                f"{cls.code} not checked: the rule failed ({type(e).__name__}: {e})")
    order = {s: i for i, s in enumerate(reversed(SEVERITIES))}
    out.sort(key=lambda f: (order[f.severity], f.code))
    return [f.as_dict() for f in out]


# unit fields (UnitConfig) each family of rules reads; a None there ("unknown") keeps the rule quiet
_SIZES = ("param_count", "sharded_bytes", "unsharded_bytes")
_NEEDS = (("wrap.", _SIZES), ("reshard.", _SIZES + ("reshard_after_forward",)), ("ac.", _SIZES),
          ("offload.", _SIZES), ("prefetch.", _SIZES + ("reshard_after_forward", "forward_prefetch")),
          ("prefetch.sync_unshard", ("unshard_async_op",)), ("optim.state_dominates", _SIZES))


def _unknown_unit_fields(run) -> set[str]:
    cfg = getattr(run, "config", None)
    fields = {f for _, fs in _NEEDS for f in fs}
    return {f for u in (cfg.units if cfg is not None else []) for f in fields if getattr(u, f, 0) is None}


__all__ = ["Context", "Finding", "RULES", "Rule", "SEVERITIES", "diagnose", "register"]
