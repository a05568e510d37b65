"""Numbers with their units, one convention for every stage that writes one (rules' evidence text, presenters,
dashboard): memory and message sizes in binary units (B, KiB, MiB, GiB: powers of 1024); bandwidth in decimal
units (MB/s, GB/s: powers of 1000, as NCCL's and nccl-tests' bus bandwidth); times in µs below a millisecond,
then ms, then s; a missing value is "—"; a fix's code in 80 columns. No imports of the package's: the diagnosis uses
it without reaching into the presenters."""

from __future__ import annotations

import io
import textwrap
import tokenize

MISSING = "—"
ROOT_LABEL = "(root)"  # the root FSDP unit's display name (its module path is "")


def fsdp_label(name: str, roots=()) -> str:
    """The label FSDP2's profiler ranges give a unit ("FSDP::pre_forward (blocks.0)", a trace row's unit): its path
    relative to its FSDP root module, the root ROOT_LABEL. The records name units from the watched model, which may
    hold the root (a LightningModule's ``self.model``: the records' "model.blocks.0" is the trace's "blocks.0", their
    root "model" the trace's "(root)"); ``roots``: the root units' names in the records."""
    if name == "" or name in roots:
        return ROOT_LABEL
    for r in sorted((r for r in roots if r), key=len, reverse=True):
        if name.startswith(r + "."):
            return name[len(r) + 1:]
    return name


def unit_label(name) -> str:
    """Display name of an FSDP unit: "" is the root; None (outside every unit) is "—"."""
    if name is None:
        return MISSING
    return ROOT_LABEL if name == "" else str(name)


# the segment a wrapper module puts in the path of the module it wraps, and the call that wraps it: checkpoint_wrapper's
# (accelerate's FSDP2 plugin shards each layer inside its wrapper: "layers.0._checkpoint_wrapped_module", beside the
# wrapper's own empty unit "layers.0") and torch.compile's
WRAPPER_SEGMENTS = {"_checkpoint_wrapped_module": "checkpoint_wrapper", "_orig_mod": "torch.compile"}


def module_path(name):
    """The path in the user's model of the module a unit's name stands for, the wrappers' segments
    (``WRAPPER_SEGMENTS``) taken out: "layers.0._checkpoint_wrapped_module" -> "layers.0"; a grouped unit's
    ("norm, lm_head") member by member; "" (the root) and None as they are. What matches a unit across two runs and
    what the tables print; a fix's code names the real path."""
    if not name:
        return name
    return ", ".join(".".join(p for p in m.split(".") if p not in WRAPPER_SEGMENTS) for m in str(name).split(", "))


def same_group(known, names) -> dict[str, str]:
    """Of ``names``, the grouped units' ("norm, lm_head") that list the modules of a ``known`` group in another order
    -> that group's name. FSDP2's labels list a group's modules in module-tree order, the records as ``fully_shard``
    was given them (accelerate's tied "model.norm, model.embed_tokens, lm_head" is a trace's "model.embed_tokens,
    model.norm, lm_head"): the same unit."""
    of = {frozenset(k.split(", ")): k for k in known if k and ", " in k}
    return {n: of[m] for n in names if n and ", " in n and (m := frozenset(n.split(", "))) in of and of[m] != n}


def list_item(name) -> str:
    """One name of a comma-joined list: a grouped unit's ("norm, lm_head") in brackets, or the list reads as one
    name more per comma (accum.regather's "model.norm, lm_head" among 4 units read as 5, a new-user trial)."""
    return f"[{name}]" if isinstance(name, str) and ", " in name else str(name)

# C0 and C1 control characters but newline and tab, DEL, and the bidi overrides that reorder what a terminal shows
_CONTROL = {c: None for c in [*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0), *range(0x202a, 0x202f),
                              *range(0x2066, 0x206a)]}


def memory_peak_where(at) -> str:
    """Where a memory peak happened (a ``MemoryPeakAt``): "step 3, layers.0 forward_end" ("outside the units": in no
    unit's forward or backward, the loss's phase; "(model)" there read as a unit the tables name "(root)": a new-user
    trial)."""
    if at.unit is None:
        return ", ".join([f"step {at.step}", "outside the units", *([at.phase] if at.phase else [])])
    return f"step {at.step}, {unit_label(at.unit)} {at.phase or ''}".strip()


def printable(text: str) -> str:
    """``text`` without control characters (an escape sequence in a module or file name must never reach a
    terminal raw: it could retitle the window, hide text or move the cursor)."""
    return text.translate(_CONTROL) if not text.isprintable() else text


def fmt_list(items: list[str], n: int = 6) -> str:
    """Names in a sentence, the first ``n`` and a count of the rest ("a, b … (+3)"); the root's "" as "(root)", a
    grouped unit in brackets (``list_item``)."""
    items = [list_item(i) if i else ROOT_LABEL for i in items]
    return ", ".join(items[:n]) + (f" … (+{len(items) - n})" if len(items) > n else "")


def ranks_phrase(ranks) -> str:
    """"rank 1", "ranks 0, 1": ranks named with the noun's number."""
    ranks = [str(r) for r in ranks]
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}"


def runs(xs: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted integers: [1, 5, 6, 7] -> [(1, 1), (5, 7)]."""
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out


def ranges_text(xs) -> str:
    """"2–3, 7–8, 11": distinct integers in order, each run of consecutive ones as a range (a range over a gap would
    name numbers that were not there)."""
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs(sorted({int(x) for x in xs})))


def steps_phrase(steps) -> str:
    """"step 6", "steps 6–7", "steps 2–3, 7–8": the steps named (``ranges_text``)."""
    n = len({int(s) for s in steps})
    return f"step{'s' * (n > 1)} {ranges_text(steps)}"


def shift_at(shift) -> str:
    """When a step time changed (a ``LevelShift``): "at step 20", or "between steps 19 and 21" where the steps
    between were left out of the statistics."""
    if shift.first_after == shift.last_before + 1:
        return f"at step {shift.first_after}"
    return f"between steps {shift.last_before} and {shift.first_after}"


def fmt_bytes(n, prec: int = 2) -> str:
    """Bytes in binary units: "774.50 KiB", "1.25 GiB" (``prec`` decimals; 1 where a table is tight)."""
    if n is None:
        return MISSING
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{sign}{n / div:.{prec}f} {unit}"
    return f"{sign}{n:.0f} B"


def fmt_ms(ms, signed: bool = False) -> str:
    """A duration given in ms: "850 µs", "2.50 ms", "12.3 ms", "1.25 s" (``signed``: "+" on positive values)."""
    if ms is None:
        return MISSING
    ms = float(ms)
    sign = "+" if signed and ms > 0 else ""
    a = abs(ms)
    if a >= 1000:
        return f"{sign}{ms / 1000:.2f} s"
    if a >= 10:
        return f"{sign}{ms:.1f} ms"
    if a >= 1:
        return f"{sign}{ms:.2f} ms"
    return f"{sign}{ms * 1000:.0f} µs"


def fmt_duration(s: float) -> str:
    """A span of wall time in its unit, from seconds: "98 s", "11 min", "2.5 h", "3.0 days"."""
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.1f} days"


def fmt_us(us, signed: bool = False) -> str:
    """A duration given in µs, formatted as :func:`fmt_ms`."""
    return MISSING if us is None else fmt_ms(us / 1e3, signed)


def fmt_bw(gbps) -> str:
    """A bandwidth given in GB/s (decimal): "29.8 MB/s", "1.25 GB/s"."""
    if gbps is None:
        return MISSING
    return f"{gbps:.3g} GB/s" if gbps >= 1 else f"{gbps * 1e3:.3g} MB/s"


def fmt_mesh(mesh: dict) -> str:
    """"fsdp 2 × tp 2": a device mesh's dims (name -> size, RunConfig.mesh) in words."""
    return " × ".join(f"{k} {v}" for k, v in mesh.items())


def fmt_pct(x) -> str:
    return MISSING if x is None else f"{x:.1f}%"


def fmt_share(fraction, decimals: int = 0, under: float | None = None) -> str:
    """A share (0.43 of the step, of capacity) as a percent with ``decimals`` ("43%"), never "0%" or "100%" for one
    that is neither: there one decimal more ("0.4%", "99.6%"), or "<0.1%", ">99.9%". Every text that prints a
    measured share goes through it (a new-user trial: a peak at "0% of 1.00 GiB" in the memory lines and the quiet
    reasons beside "0.4% of capacity" in ac.unneeded's title, the one that said it right). ``under``: a threshold
    the share is below, said beside it: decimals are added (three at most) until the share reads under it
    ("2.96% (fires from 3%)", where whole percents read "3% (fires from 3%)", a rule quiet at its own threshold)."""
    if fraction is None:
        return MISSING
    if under is not None and fraction < under:
        while decimals < 3 and round(100 * fraction, decimals) >= round(100 * under, decimals):
            decimals += 1
    pct = 100 * fraction
    text = f"{pct:.{decimals}f}"
    if pct in (0, 100) or float(text) not in (0, 100):
        return text + "%"
    if decimals == 0 and float(f"{pct:.1f}") not in (0, 100):
        return f"{pct:.1f}%"
    return "<0.1%" if pct < 50 else ">99.9%"


# the unit an evidence key names, by one of its "_"-separated words: "rs_bytes_per_call_median" is bytes
_KEY_UNITS = (("bytes", fmt_bytes), ("ms", fmt_ms), ("us", fmt_us), ("pct", lambda v: f"{v:.1f}%"),
              ("gbps", fmt_bw))


def evidence_labels(evidence: dict) -> dict[str, str]:
    """Each evidence key's label (:func:`evidence_label`), the unit word kept where two keys would read alike
    ("reshard_after_forward_false_ms" and "..._bytes": both "reshard after forward false" without it)."""
    out = {k: evidence_label(k, v) for k, v in evidence.items()}
    seen: dict[str, int] = {}
    for lab in out.values():
        seen[lab] = seen.get(lab, 0) + 1
    return {k: (lab if seen[lab] == 1 else k.replace("_", " ")) for k, lab in out.items()}


def evidence_label(key: str, v) -> str:
    """An evidence key as its row's label: words, without the unit word that :func:`fmt_value` writes into the value
    ("step_p50_ms" -> "step p50", shown "754.6 ms"; "rs_bytes_per_call_median" -> "rs per call median"). The JSON
    keeps the key. Shared by every stage that prints evidence."""
    words = key.split("_")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        low = [w.lower() for w in words]
        unit = next((u for u, _ in _KEY_UNITS if u in low), None)
        if unit is not None and len(words) > 1:
            del words[low.index(unit)]
    return " ".join(_LABEL_WORDS.get(w, w) for w in words)


# words of evidence keys as a label writes them ("reducescatters_per_unit_per_step": "reduce-scatters per unit ...")
_LABEL_WORDS = {"ag": "AG", "rs": "RS", "allgather": "all-gather", "allgathers": "all-gathers",
                "reducescatter": "reduce-scatter", "reducescatters": "reduce-scatters", "mfu": "MFU"}


def evidence_rows(evidence: dict, max_items: int = 8, fmt=None) -> list[tuple[str, str]]:
    """(label, value) for each evidence item, as every presenter prints them (terminal, HTML, dashboard; ``fmt``:
    a presenter's own ``fmt_value(key, value)``). A list shows its first ``max_items``, and how many more: of its
    count where one stands beside it (``late_steps`` and ``late_step_count``: a long run's list is cut, and "(+42)"
    of the cut list read beside a count of 562, a new-user trial). An item without a value (None: not measured on
    this run, or not applicable, as ``read_on_straggler`` without a straggler) is left out, as "—" it only took a
    line (the JSON keeps it)."""
    labels = evidence_labels(evidence)
    fmt = fmt or (lambda k, v: fmt_value(k, v, max_items=max(1, len(v)) if isinstance(v, list) else 8))
    rows = []
    for k, v in evidence.items():
        if v is None:
            continue
        if isinstance(v, list) and v:
            words = k.split("_")  # its count: late_steps' late_step_count, or a count of the same first word's
            keys = ["_".join([*words[:-1], words[-1].rstrip("s"), "count"])]
            keys += [x for x in evidence if x.endswith("_count") and x.split("_")[0] == words[0]]
            count = next((evidence[x] for x in keys if x in evidence), None)
            total = count if isinstance(count, int) and not isinstance(count, bool) and count >= len(v) else len(v)
            shown = v[:max_items]
            text = fmt(k, shown) + (f" … (+{total - len(shown)})" if total > len(shown) else "")
        else:
            text = fmt(k, v)
        rows.append((labels[k], text))
    return rows


def fmt_value(key: str, v, max_items: int = 8) -> str:
    """An evidence value formatted by the unit its key names (a word of the key: ``bytes``, ``ms``, ``us``,
    ``pct``, ``gbps``; e.g. ``exposed_ms_per_step``, ``rs_bytes_per_call_median``); a plain count with thousands
    separators, never in exponent notation; lists shortened (a grouped unit's name in brackets), dicts formatted item by item. Shared by every stage
    that prints evidence (terminal, HTML, dashboard)."""
    if isinstance(v, bool) or v is None:
        return MISSING if v is None else str(v).lower()
    if isinstance(v, (int, float)):
        words = key.lower().split("_")
        for word, fmt in _KEY_UNITS:
            if word in words:
                return fmt(v)
        if isinstance(v, float) and not v.is_integer():
            return f"{v:,.4f}".rstrip("0").rstrip(".") if abs(v) < 1e4 else f"{v:,.0f}"
        return f"{int(v):,}"
    if isinstance(v, (list, tuple)):
        if not v:
            return "none"
        s = ", ".join(list_item(x) for x in v[:max_items])
        return s + (f" … (+{len(v) - max_items})" if len(v) > max_items else "")
    if isinstance(v, dict):
        return ", ".join(f"{k}: {fmt_value(k, x)}" for k, x in v.items())
    return str(v)


#: the end of the one line that tells how a run ended where not every rank finished (store.reader.run_end_line), by
#: which presenters tell it from a file skipped: it is printed "run ended: ...", not "skipped: ..." (nothing was)
RUN_END_TAIL = "; the completed steps of every rank are used"


#: the columns a fix's lines fit in: the rules write them so (diagnose.base.Rule.finding fits its comments), and the
#: terminal prints a fix unwrapped, for copying
CODE_WIDTH = 80


def _comment_indent(line: str, indent: str) -> str:
    """The spaces after a comment line's "# " beyond the first (an indented list under a header: "#   layer1, ..."),
    kept on its wrapped lines."""
    text = line[len(indent):].lstrip("#")
    return " " * max(0, len(text) - len(text.lstrip(" ")) - 1)


def fit_comments(code: str, width: int = CODE_WIDTH) -> str:
    """``code`` with each comment line over ``width`` columns wrapped under itself, at its indent (an indented list
    keeping its indent), and a comment after code over it moved above that code, wrapped; the code itself as it is:
    two new-user trials' 80-column terminals wrapped the fixes' long comments mid-word (lines of 87 to 126 columns).
    Each comment line is its own text, never joined to the next: a rule writes one text on one line, however long.
    Joining a line to the next when it did not end in ".", ":", ")" or ";" ran three separate comments into one
    ("... would add collectives for nothing lm_head, transformer.wte share a parameter ... the root last: ...": a
    new-user trial's GPT-2 plan), and a rule's comments end without a full stop. Comments only move, so the fix runs
    as the rule wrote it: diagnose.base.Rule.finding fits every fix so, the report (JSON, HTML, dashboard) holding
    it fitted; the terminal fits it again (a report written before). Code that does not tokenize (a command line) is
    returned as it is."""
    lines = code.split("\n")
    if all(len(ln) <= width for ln in lines):
        return code
    try:
        comments = {t.start[0] - 1: t.start[1] for t in tokenize.generate_tokens(io.StringIO(code).readline)
                    if t.type == tokenize.COMMENT}
    except (tokenize.TokenError, SyntaxError):
        return code

    def wrap(indent: str, text: str, lead: str = "") -> list[str]:
        head = f"{indent}# {lead}"
        return [head + w for w in textwrap.wrap(text, max(20, width - len(head)), break_long_words=False,
                                                break_on_hyphens=False)]

    out: list[str] = []
    for i, ln in enumerate(lines):
        col = comments.get(i)
        indent = ln[:len(ln) - len(ln.lstrip())]
        if col is not None and len(ln) > width:
            if col == len(indent):  # a comment line
                out += wrap(indent, ln.strip().lstrip("#").strip(), _comment_indent(ln, indent))
                continue
            out += wrap(indent, ln[col:].lstrip("#").strip())  # a comment after code: above it
            ln = ln[:col].rstrip()
        out.append(ln)
    return "\n".join(out)
