"""Findings and the rule shape (after torch.profiler's ``_pattern_matcher.Pattern``: name, description,
match, report). A rule is a small class over plain typed data: the Run and the report's sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..report_sections import Finding, Recommendation, Report
from ..store import Run
from .snippets import complete

SEVERITIES = ("info", "warning", "critical")


@dataclass
class Context:
    """What every rule may look at: the run (configs, raw steps) and the report's sections already computed,
    by attribute (``ctx.report.steps``, ``.units``, ``.memory``, ``.overlap``, ``.throughput``, ``.verdict``,
    ``.comm``: None where nothing fed the section). A report's JSON form is read into a ``Report``."""

    run: Run
    report: Report

    def __post_init__(self):
        self.report = Report.of(self.report)

    @property
    def config(self):
        return self.run.config


class Rule:
    """One diagnosis rule. Subclasses set ``code``, ``name`` and ``description`` and implement ``match``."""

    code: ClassVar[str] = ""
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def match(self, ctx: Context) -> list[Finding]:
        raise NotImplementedError

    def finding(self, severity: str, title: str, evidence: dict, text: str, code: str = "", **kw) -> Finding:
        assert severity in SEVERITIES, severity
        # the snippet with the imports and mesh it uses (diagnose/snippets.py): it runs pasted as it is
        return Finding(code=self.code, severity=severity, title=title, evidence=evidence,
                       recommendation=Recommendation(text=text, code=complete(code)), **kw)


RULES: list[type[Rule]] = []


def register(cls: type[Rule]) -> type[Rule]:
    RULES.append(cls)
    return cls
