"""The HTML compare report (``fsdp-doctor compare --html``): one self-contained file with the terminal's
summary and tables (``present.compare.tables``) and the comparison's figures (``present.compare_figures``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..compare_sections import Comparison
from .compare import side_text, tables
from .compare_figures import FIGURES
from .html import _esc, _figure, _plotlyjs_script, html_page, partial_plotlyjs


def _table(t) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in t.header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(x)}</td>" for x in r) + "</tr>" for r in t.rows)
    note = f"<p class='note'>{_esc(t.note)}</p>" if t.note else ""
    return f"<h2>{_esc(t.title)}</h2>" + (f"<table><tr>{head}</tr>{body}</table>" if t.rows else "") + note


def render_compare_html(c: Comparison) -> str:
    parts = [f"<h1>fsdp-doctor compare</h1><p class='facts'>A: {_esc(side_text(c.a))}<br>B: "
             f"{_esc(side_text(c.b))}</p>",
             f"<div class='verdict'>{_esc(c.summary)}</div>"]
    parts += [f"<p class='note'>{_esc(n)}</p>" for n in c.notes]
    bundle = partial_plotlyjs()
    if bundle is not None:
        parts.append(_plotlyjs_script(bundle))
    first = bundle is None
    parts += [_table(t) for t in tables(c)]
    for build in FIGURES:
        fig = build(c)
        if fig is not None:
            parts.append(f"<div class='fig'>{_figure(fig, first)}</div>")
            first = False
    data = json.dumps(c.to_builtins(), default=str).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='fsdp-doctor-compare'>{data}</script>")
    return html_page(f"fsdp-doctor compare — {c.a.path} vs {c.b.path}", "".join(parts))


def write_compare_html(c: Comparison, path: Path) -> Path:
    from ..store.layout import write_atomic

    return write_atomic(path, render_compare_html(c))
