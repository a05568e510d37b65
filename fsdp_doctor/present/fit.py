"""Tables that fit the terminal: every presenter table of the terminal report is built here, at the console's
width. Numbers never wrap or get cut: where the table is wider than the terminal, the least important columns
are left out (and named in the caption); only the name columns (units, categories) wrap, between words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from rich import box
from rich.cells import cell_len
from rich.markup import escape
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class Col:
    name: str
    justify: str = "right"
    drop: int = 0  # 0: always shown; where the table does not fit, the highest ``drop`` goes first
    wrap: bool = False  # a name column: may wrap between words (never inside one); numbers never wrap
    fold: int = 0  # a name column of long identifiers (kernel names): folded inside a word past this width
    # left out with the column before it (a rank's "%" beside its bytes: kept alone, "rank 2 % %" headed rank 3's
    # shares with its bytes left out, a new-user trial's 4 ranks at 80 columns)
    follows: bool = False


def _len(cell) -> int:
    if isinstance(cell, Text):
        return max((cell_len(line) for line in cell.plain.splitlines()), default=0)
    return max((cell_len(line) for line in str(cell).splitlines()), default=0)


def _min_len(cell) -> int:
    """The narrowest a wrapping cell can get: its longest word, the first with the indent before it (a nested
    unit's name, "  embed_tokens", folded to "  embed_toke" / "ns" where only the word was counted)."""
    text = cell.plain if isinstance(cell, Text) else str(cell)
    lead = [cell_len(line) - cell_len(line.lstrip()) + cell_len(line.split()[0])
            for line in text.splitlines() if line.strip()]
    return max([*(cell_len(w) for w in text.split()), *lead], default=0)


def _widths(cols: Sequence[Col], rows: Sequence[Sequence]) -> tuple[list[int], list[int]]:
    """Per column: its natural width and the narrowest it may get (a name column: its longest word)."""
    natural = [max([cell_len(c.name), *(_len(r[i]) for r in rows)]) for i, c in enumerate(cols)]
    narrow = [max([_min_len(c.name), *(_min_len(r[i]) for r in rows)]) if c.wrap else natural[i]
              for i, c in enumerate(cols)]
    narrow = [min(n, c.fold) if c.wrap and c.fold else n for n, c in zip(narrow, cols)]
    return natural, narrow


def fit_columns(cols: Sequence[Col], narrow: Sequence[int], width: int, gap: int = 3) -> list[int]:
    """Indices of the columns kept so that the table fits ``width`` cells (the box's edges and ``gap`` cells
    between columns: padding, separator, padding), each column at its narrowest (``_widths``)."""
    keep = list(range(len(cols)))

    def need(ix):
        return sum(narrow[i] for i in ix) + gap * (len(ix) - 1) + 2

    for i in sorted((i for i, c in enumerate(cols) if c.drop), key=lambda i: (-cols[i].drop, -i)):
        if need(keep) <= width:
            break
        if i not in keep:  # (gone with the column it follows)
            continue
        keep.remove(i)
        j = i + 1
        while j < len(cols) and cols[j].follows:
            if j in keep:
                keep.remove(j)
            j += 1
    return keep


def fitted_table(title: str, cols: Sequence[Col], rows: Sequence[Sequence], width: int,
                 styles: Optional[Sequence[Optional[str]]] = None, caption: Optional[str] = None,
                 compact: bool = False) -> Table:
    """A rich table of ``rows`` (cells: str or Text) with the columns that fit ``width``; the columns left out
    are named in the caption. ``compact``: one cell between columns instead of three. The title, the caption and
    every str cell are plain text, never rich markup: a grouped unit's name in a list reads "[norm, lm_head]"
    (``units.list_item``), which rich took for a style tag and dropped (compare's "2 units differ:
    model.embed_tokens," after a new-user trial's Qwen3-MoE rerun with wrap.params_in_root's fix, whose second
    unit was [model.norm, lm_head])."""
    gap = 1 if compact else 3
    natural, narrow = _widths(cols, rows)
    keep = fit_columns(cols, narrow, width, gap=gap)
    fixed = _shared_widths([cols[i] for i in keep], [natural[i] for i in keep], [narrow[i] for i in keep],
                           width - gap * (len(keep) - 1) - 2)
    dropped = [cols[i].name for i in range(len(cols)) if i not in keep and not (cols[i].follows and i - 1 not in keep)]
    notes = [caption] if caption else []
    if dropped:
        notes.append(f"not shown at {width} columns: {', '.join(dropped)} (a wider terminal shows them)")
    t = Table(title=escape(title), box=box.SIMPLE_HEAD, padding=(0, 0 if compact else 1), title_justify="left",
              pad_edge=False, caption=escape("\n".join(notes)) or None, caption_justify="left", caption_style="dim")
    for k, i in enumerate(keep):
        c = cols[i]
        t.add_column(c.name, justify=c.justify, no_wrap=not c.wrap, min_width=narrow[i], width=fixed[k],
                     overflow="fold" if c.wrap else "ellipsis")
    for j, r in enumerate(rows):
        t.add_row(*(escape(r[i]) if isinstance(r[i], str) else r[i] for i in keep),
                  style=styles[j] if styles else None)
    return t


def _shared_widths(cols: Sequence[Col], natural: Sequence[int], narrow: Sequence[int], room: int) -> list:
    """Where the columns' natural widths exceed ``room`` (the cells left for content), the name columns' widths:
    each its narrowest, and what is left shared in proportion to what each would still take, the figures' columns
    whole (None: a column rich sizes itself). Rich's own collapse can leave such a table a few cells too wide and
    crop its last column."""
    if sum(natural) <= room:
        return [None] * len(cols)
    wrap = [k for k, c in enumerate(cols) if c.wrap]
    left = room - sum(natural[k] for k in range(len(cols)) if not cols[k].wrap) - sum(narrow[k] for k in wrap)
    want = {k: natural[k] - narrow[k] for k in wrap}
    total = sum(want.values())
    out: list = [None] * len(cols)
    for k in wrap:
        out[k] = narrow[k] + (min(want[k], left * want[k] // total) if total and left > 0 else 0)
    return out
