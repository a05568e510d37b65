"""torch.compile leaving modules eager: Dynamo's recompile limit hit on a forward that the modules compiled in place
share (a new-user trial: Hugging Face Llama decoder layers, each compiled in place, recompiled once per layer, and
past 8 layers every later one ran eager, Dynamo's one warning lost in the run's log and nothing in the report)."""

from __future__ import annotations

import math
import re
import statistics
from typing import Optional

from .. import estimate as E
from .. import snippets as S
from ..base import Context, Rule, register
from ...units import fmt_list, fmt_ms

#: the eager units' time is a gain where it exceeds the compiled ones' median by this share (under it: the host's
#: noise, or a backend that fuses nothing, eager's or aot_eager's, where compiled and eager take the same time)
EAGER_SLOWER_MIN_SHARE = 0.10
#: a raised limit is the fix where each module needs at most this many compiled variants: one for training and one
#: for an evaluation under no_grad (Dynamo guards on the grad mode). More variants per module are recompiles of the
#: same module (a new shape each time, a value that changes): a higher limit only compiles more of them
MAX_VARIANTS_PER_MODULE = 2
#: Module._call_impl's file: a limit hit on code there is on what every compiled module runs
_NN_MODULE = "torch/nn/modules/module.py"


def _hits(ctx: Context) -> list[tuple[int, int, object]]:
    """(rank, step, RecompileLimit) of every limit hit the step records hold, by rank then step."""
    ranks = getattr(ctx.run, "ranks", None) or {}
    return [(int(r), s.step, h) for r, rd in sorted(ranks.items(), key=lambda kv: int(kv[0]))
            for s in rd.steps for h in getattr(s, "recompile_limits", None) or []]


def _where(h) -> str:
    """A code object as the report names it: "forward_with_checkpointing (transformers/modeling_layers.py:89)", its
    file from the package directory on; "unknown" where Dynamo's warning was not seen."""
    if not h.function:
        return "unknown"
    path = h.file.replace("\\", "/")
    short = re.sub(r"^.*/(?:site-packages|dist-packages)/", "", path)
    return f"{h.function} ({short if short != path else path.rsplit('/', 1)[-1]}:{h.line})"


def _sharing(h, compiled: list) -> list:
    """The compiled modules whose forward is the code that hit the limit (its cache is theirs); every compiled module
    where the code is Module's own or not known."""
    if not h.function or h.file.replace("\\", "/").endswith(_NN_MODULE):
        return compiled
    return [m for m in compiled if (m.function, m.file, m.line) == (h.function, h.file, h.line)]


def _unit_ms(ctx: Context) -> dict[str, float]:
    """Each timed unit's forward and backward (ms per step, the report's medians): for a unit compiled in place,
    its compiled call and its backward."""
    return {u.name: u.timing.fwd_ms + u.timing.bwd_ms for u in E.units(ctx) if u.has_timing}


@register
class RecompileLimitHit(Rule):
    code = "compile.recompile_limit"
    name = "torch.compile left modules eager at its recompile limit"
    description = ("Dynamo hit its recompile limit on a forward that modules compiled by torch.compile share: past "
                   "it, the modules it has no compiled variant for run eager, with one warning in the log.")
    needs = ("records",)
    severities = ("warning",)

    def match(self, ctx: Context):
        cfg = ctx.config
        compiled = list(getattr(cfg, "compiled_modules", None) or [])
        hits = _hits(ctx)
        units = getattr(cfg, "units", None) or []
        if not compiled and any(u.compiled_in_place or u.compiled_call_timed for u in units):
            # (units compiled, and no record of the compiled modules: written before the doctor recorded them)
            return self.skip("this run's records predate the doctor's record of torch.compile's modules and "
                             "Dynamo's recompile limits (RunConfig.compiled_modules): record it again")
        if not hits:
            if not compiled:
                return self.quiet("no module compiled by torch.compile, and Dynamo hit no recompile limit")
            classes = sorted({m.cls for m in compiled})
            limits = ", ".join(f"{k} {v}" for k, v in (getattr(cfg, "compile_limits", None) or {}).items())
            return self.quiet(f"Dynamo hit no recompile limit: {len(compiled)} module(s) compiled "
                              f"({', '.join(classes)})" + (f"; {limits}" if limits else ""))
        findings, seen = [], set()
        for rank, step, h in hits:
            key = (h.function, h.file, h.line, h.limit_type)
            if key in seen:
                continue
            seen.add(key)
            findings.append(self._one(ctx, h, step, rank, sorted({r for r, _, x in hits if
                                                                   (x.function, x.file, x.line, x.limit_type) == key}),
                                      compiled))
        return findings

    def _one(self, ctx: Context, h, step: int, rank: int, ranks: list[int], compiled: list):
        cfg = ctx.config
        shared = _sharing(h, compiled)
        n = len(shared)
        names = [m.name for m in shared]
        classes = sorted({m.cls for m in shared})
        # which ran eager: those of them timed around their compiled call in whose calls Dynamo compiled no frame in
        # the whole run (measured, on the rank read); where some are not timed (not units), those past the first
        # `limit` in module order, one variant each (assumed, and said)
        compiles: dict[str, int] = {}
        for s in ctx.run.ranks[rank].steps:
            for name, k in (getattr(s, "unit_compiles", None) or {}).items():
                compiles[name] = compiles.get(name, 0) + k
        timed = {u.name for u in getattr(cfg, "units", None) or [] if u.compiled_call_timed}
        measured = bool(shared) and all(m in timed for m in names)
        if measured:
            eager = [m for m in names if not compiles.get(m)]
        else:
            eager = names[h.limit:] if h.limit is not None else []
        done = [m for m in names if m not in eager]
        limit = h.limit if h.limit is not None else (getattr(cfg, "compile_limits", None) or {}).get(h.limit_type)
        variants = max(1, math.ceil(limit / len(done))) if limit and done else 1
        per_module = n > 1 and variants <= MAX_VARIANTS_PER_MODULE
        what = f"{h.limit_type} ({limit})" if limit is not None else h.limit_type
        # (Dynamo aligns its guard and the source line with runs of spaces)
        last = " ".join(h.reason.split()).rstrip(" .:")
        evidence = {"function": _where(h), "limit_type": h.limit_type, "limit": limit, "hit_at_step": step,
                    "ranks_hit": ranks, "last_reason": last or None, "modules_sharing_code": n,
                    "classes": classes, "modules_compiled": len(done), "variants_per_module": variants,
                    "eager_modules": eager, "eager_count": len(eager),
                    "eager_from": "measured: no frame compiled in their calls" if measured else
                    "module order: one variant each, the first ones compiled",
                    "hit_in_module": h.module or None}
        ms = _unit_ms(ctx)
        step_ms = E.step_ms(ctx)
        slow, gain_words, after = self._gain(ms, eager, done, step_ms)
        evidence.update(slow)
        lead = (f"Dynamo keeps one compiled variant of a code object per set of guards it checks, up to "
                f"torch._dynamo.config.{h.limit_type}" + (f" ({limit})" if limit is not None else "") +
                "; past it, it warns once and runs that code eagerly wherever none of its variants match.")
        reason = f" Dynamo's last reason: {last}." if last else ""
        if not h.function:
            where = (" Dynamo's warning was not seen (this process's logging keeps it quiet), so which code hit it is "
                     "not known; Dynamo counted the hit.")
        else:
            where = f" Here it hit it on {_where(h)}, at step {step}."
        who = (f" {n} module(s) compiled by torch.compile run that code ({', '.join(classes)}: "
               f"{fmt_list(names, 4)})" if n else " No module compiled by torch.compile runs that code (a compiled "
               "function's, or one compiled inside another)")
        ran = (f"; {fmt_list(eager, 6)} ({len(eager)} of {n}) ran eager"
               + (", no frame compiled in their calls in the whole run." if measured else
                  ", taking one variant for each module before them in module order.") if eager else
               (f"; the limit was hit in {h.module}'s call: from then on the passes like that one (an evaluation, "
                "a new shape) run it eager." if h.module else "."))
        text = lead + where + who + ran + reason
        if not per_module:
            text += (f" Each module that compiled took about {variants} variants: recompiles of the same module (a "
                     "new shape or value each time, what the last reason names), which a higher limit would only "
                     "compile more of. Make what the guard checks stable, or mark the changing size dynamic "
                     "(torch._dynamo.mark_dynamic, or compile with dynamic=True)." if n else
                     " Raising the limit compiles more variants of it; the last reason names what changes.")
            return self.finding("warning", f"torch.compile hit {what}: {h.function or 'that code'} runs eager past it",
                                evidence, text + gain_words, predicted=E.predicted(step_ms, after), ranks=ranks,
                                units=eager)
        need = n * variants
        value = n * (variants + 1)
        # the limit hit, and the other of the two where it is set lower (the specific one under the accumulated one:
        # every variant counts towards both where modules are inlined)
        now = {**(getattr(cfg, "compile_limits", None) or {}), h.limit_type: limit}
        specific = h.limit_type.removeprefix("accumulated_")
        raise_to = {name: value for name in (specific, "accumulated_" + specific)
                    if name == h.limit_type or (now.get(name) is not None and now[name] < value)}
        evidence.update(limit_needed=need, limit_suggested=value)
        cls = classes[0] if len(classes) == 1 else "module"
        code = S.recompile_limit_code(
            raise_to, f"before the model's first forward: a compiled variant of {h.function or 'the forward'} for "
            f"each of the {n} {cls} modules compiled ({variants} each), and room for one more each (an evaluation "
            "under no_grad, on which Dynamo guards)")
        text += (f" The model needs {n} x {variants} = {need} variants of it: set the limit to that before the first "
                 f"forward, with room for one more per module ({value}).")
        return self.finding(
            "warning", f"torch.compile left {len(eager)} of {n} {cls} modules eager: Dynamo hit {what}" if eager else
            f"torch.compile hit {what} on {h.function or 'their forward'}: {cls} modules run eager past it",
            evidence, text + gain_words, code, where="model", predicted=E.predicted(step_ms, after), ranks=ranks,
            units=eager)

    @staticmethod
    def _gain(ms: dict[str, float], eager: list[str], done: list[str], step_ms: Optional[float]):
        """(evidence, words, the step after) of compiling the eager units: each one's forward and backward against
        the compiled ones' median, the difference summed, where the eager ones take EAGER_SLOWER_MIN_SHARE longer;
        else no step time is predicted, and the words say why."""
        slow = [ms[m] for m in eager if m in ms]
        fast = [ms[m] for m in done if m in ms]
        if not slow or not fast:
            return {}, (" No step time is predicted: the eager modules' time was not measured apart (they are not "
                        "FSDP units the doctor times)." if eager else ""), None
        ref = statistics.median(fast)
        each = statistics.median(slow)
        extra = sum(t - ref for t in slow)
        ev = {"eager_unit_ms_p50": round(each, 3), "compiled_unit_ms_p50": round(ref, 3),
              "eager_extra_ms_per_step": round(extra, 3)}
        if each >= (1 + EAGER_SLOWER_MIN_SHARE) * ref and not step_ms:
            return ev, (f" Compiled like the others, they would save about {fmt_ms(extra)} per step (no step time was "
                        "recorded to set it against)."), None
        if each < (1 + EAGER_SLOWER_MIN_SHARE) * ref:
            return ev, (f" No step time is predicted: the eager modules took {fmt_ms(each)} each (forward and "
                        f"backward, per step) against {fmt_ms(ref)} for the compiled ones, not "
                        f"{100 * EAGER_SLOWER_MIN_SHARE:.0f}% slower on this run (a backend that fuses nothing, as "
                        "eager or aot_eager, or modules too small to tell)."), None
        return ev, (f" Compiled like the others, they would save about {fmt_ms(extra)} per step: {fmt_ms(each)} "
                    f"each (forward and backward) against the compiled ones' {fmt_ms(ref)}."), step_ms - extra
