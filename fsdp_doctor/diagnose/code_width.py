"""A fix's Python code in 80 columns, whatever wrapped it last.

Rules write their snippets at 80 columns, but the framework rewrites that run after them (``snippets.for_trainer``
indents a fix by 8 inside a ``TrainerCallback``, ``calls_words`` swaps a short comment for a long one) can push lines
past it: a Phi-3 under the Trainer printed a 169-column comment in ``reshard.zero2_affordable``'s fix, and 87 of the
108 Trainer fixes of five sessions' new-user trials had lines of 81-176 columns (the callback's class line, a names
list, long module names), 1 of their 407 other fixes. ``fit`` breaks them where Python allows, from the code's own
tokens, so no name is ever split, nor a string but into two adjacent ones:

- a comment line is rewrapped at its indentation (``snippets.comment``), its paragraph (the comment lines after it at
  that indentation) flowing on;
- a comment after code goes on its own line(s) above that line, at its indentation;
- code breaks after a comma inside brackets, continued under the bracket's first item (or, past half the width,
  four columns right of an earlier bracket's first item, or of the piece it continues); where no comma fits, a
  string inside brackets breaks after a dot, as two adjacent strings.

The result must parse to the same syntax tree as the code given (comments and line breaks inside brackets are not
in it), else the code is returned as it was; code that does not parse (a fragment) is returned as it was.
"""

from __future__ import annotations

import ast
import io
import tokenize

from .snippets import BEFORE_SHARDING, SHARDING_GOES_HERE, comment

WIDTH = 80


def fit(code: str, width: int = WIDTH) -> str:
    """``code`` with every line of ``width`` columns at most where a comment, a comma or a string inside brackets
    allows."""
    lines = code.split("\n")
    if all(len(ln) <= width for ln in lines):
        return code
    try:
        before = ast.dump(ast.parse(code))
    except (SyntaxError, ValueError):
        return code
    stuck: set[str] = set()  # lines nothing can break
    for _ in range(4 * len(lines)):
        at = next((i for i, ln in enumerate(lines) if len(ln) > width and ln not in stuck), None)
        if at is None:
            break
        try:
            toks = list(tokenize.generate_tokens(io.StringIO("\n".join(lines)).readline))
        except (SyntaxError, tokenize.TokenError):
            return code
        new = _fit_line(lines[at], [t for t in toks if t.start[0] == at + 1], _depth_before(toks, at + 1), width)
        if new == [lines[at]]:
            stuck.add(lines[at])
            continue
        end = at + 1
        if len(new) > 1 and end < len(lines) and _indent(lines[end]) == _indent(new[-1]):
            last, nxt = new[-1].lstrip(), lines[end].lstrip()
            # a comment's last words flow on into the next comment line, the paragraph's ("# its fused" then
            # "# implementation," and "# one kernel per update": optim.unfused_step's under the Trainer)
            if last.startswith("#") and nxt.startswith("#") and nxt != SHARDING_GOES_HERE:
                new[-1] += " " + nxt.lstrip("#").strip()
                end += 1
            # a list's item broken onto a line of its own flows on into the next line of the same list
            elif last.endswith(",") and not nxt.startswith("#") and _depth_before(toks, end + 1) > 0:
                new[-1] += " " + nxt
                end += 1
        lines[at:end] = new
    fitted = "\n".join(lines)
    try:
        return fitted if ast.dump(ast.parse(fitted)) == before else code
    except SyntaxError:
        return code


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _depth_before(toks: list[tokenize.TokenInfo], row: int) -> int:
    """How many brackets are open where line ``row`` starts."""
    depth = 0
    for t in toks:
        if t.start[0] >= row:
            break
        if t.type == tokenize.OP:
            depth += (t.string in "([{") - (t.string in ")]}")
    return depth


def _fit_line(line: str, toks: list[tokenize.TokenInfo], depth: int, width: int) -> list[str]:
    """One line over ``width`` as the lines that replace it (itself where nothing can be broken)."""
    indent = _indent(line)
    note = next((t for t in toks if t.type == tokenize.COMMENT), None)
    if note is not None and not line[:note.start[1]].strip():  # a comment line
        return comment(_glued(note.string), indent, width)
    above = []
    if note is not None:  # a comment after code: above it, the code alone
        above = comment(_glued(note.string), indent, width)
        line = line[:note.start[1]].rstrip()
        toks = [t for t in toks if t is not note]
    return above + _break_at_commas(line, toks, depth, indent, width)


def _glued(note: str) -> str:
    """A comment's text, the words that say where a fix goes kept on one line (snippets.fix_place and the tests
    read them: BEFORE_SHARDING), as ``comment`` keeps a number with its unit."""
    return note.lstrip("#").strip().replace(BEFORE_SHARDING, BEFORE_SHARDING.replace(" ", "\0"))


def _break_at_commas(line: str, toks: list[tokenize.TokenInfo], depth: int, indent: str, width: int) -> list[str]:
    """``line`` broken after commas inside brackets, each piece continued under its bracket's first item; where no
    comma fits, a string inside brackets after one of its dots, as two adjacent strings (Python joins them: one
    constant, as before), the second under the first (a module name 84 columns long, a ConvNeXt's checkpointed
    layer's, in a Trainer callback's ``forward_order``)."""
    opened: list[int] = []  # the columns after the brackets opened on this line and still open
    breaks = []  # (the column the line breaks at, where it goes on from there, the quote a broken string needs)
    for t in toks:
        inside = bool(opened) or depth > 0
        if t.type == tokenize.STRING and inside and _plain(t.string):
            breaks += [(t.start[1] + i + 1, t.start[1], t.string[0], tuple(opened))
                       for i, ch in enumerate(t.string[:-2]) if ch == "." and i > 0]
        if t.type != tokenize.OP:
            continue
        if t.string in "([{":
            opened.append(t.end[1])
        elif t.string in ")]}":
            if opened:
                opened.pop()
            else:
                depth -= 1
        elif t.string == "," and inside:
            breaks.append((t.end[1], opened[-1] if opened else len(indent), "", tuple(opened)))
    pieces, start, lead, carry = [], 0, "", ""
    shifts = [(0, 0)]  # (where in ``line`` a piece starts, how far right of it its text now stands)
    while len(lead) + len(carry) + len(line) - start > width:
        fits = [b for b in breaks if b[0] > start and len(lead) + len(carry) + b[0] - start + len(b[2]) <= width]
        if not fits:
            break
        col, under, quote, brackets = ([b for b in fits if not b[2]] or fits)[-1]  # the last comma, else a dot
        pieces.append(lead + carry + line[start:col].rstrip() + quote)
        printed = [c + next(shift for at, shift in reversed(shifts) if at <= c) for c in (*brackets, under)]
        # under its bracket's first item; that past half the width, four columns right of the last bracket before
        # it (a list's items line up), else of the piece it continues
        near = [c for c in printed[:-1] if c <= width // 2]
        lead = " " * (printed[-1] if printed[-1] <= width // 2 else
                      near[-1] + 4 if near else max(len(lead), len(indent)) + 4)
        carry = quote
        start = col if quote else col + len(line[col:]) - len(line[col:].lstrip())
        shifts.append((start, len(lead) + len(carry) - start))
    return pieces + [lead + carry + line[start:]]


def _plain(literal: str) -> bool:
    """A one-line string literal without prefix or escapes ('layers.0'), which splits into two by a quote."""
    return literal[:1] in ("'", '"') and literal[:3] not in ("'''", '"""') and "\\" not in literal
