"""Diagnose: rules over the analyses, each finding with evidence, a fix and its predicted gain."""

from __future__ import annotations

import logging

from .base import RULES, SEVERITIES, Context, Finding, Rule, register
from . import rules as _rules  # noqa: F401  (registers the rules)

log = logging.getLogger("fsdp_doctor")


def diagnose(run, report: dict) -> list[dict]:
    """Runs every registered rule; a rule that fails is reported as an info finding, never a crash."""
    ctx = Context(run=run, report=report)
    out: list[Finding] = []
    for cls in RULES:
        try:
            out.extend(cls().match(ctx))
        except Exception as e:  # noqa: BLE001
            log.warning("fsdp_doctor: rule %s failed (%s: %s)", cls.code, type(e).__name__, e)
    order = {s: i for i, s in enumerate(reversed(SEVERITIES))}
    out.sort(key=lambda f: (order[f.severity], f.code))
    return [f.as_dict() for f in out]


__all__ = ["Context", "Finding", "RULES", "Rule", "SEVERITIES", "diagnose", "register"]
