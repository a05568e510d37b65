"""torch.compile's compile time in each step, read from Dynamo's own timing table.

Dynamo appends the seconds of each timed compile phase to ``torch._dynamo.utils.compilation_time_metrics`` (key ->
list), torch 2.6 to 2.13 alike. Two of its keys are the outermost compiles a training step runs into: a frame
compiled by Dynamo (``_compile.compile_inner``: the forward's graph, AOT autograd's backward compiled with it, a
recompile, compiled autograd's backward graph, a compiled ``optimizer.step``) and AOT autograd's backward compiled
lazily at the first backward (``backward._backward_impl``). The step's share is what those lists grew by since the
last step: two lengths read per step, nothing installed. Where Dynamo was never imported nothing compiled, and the
table is not imported for it.

Before this a recompile (a shape change at step 10 of a 2-rank run, each block compiled in place) read as
"compute +1595.8 ms in forward/backward/optimizer", kept in the step statistics (p99 1526.8 ms, cv 184%).

The graph breaks Dynamo met while compiling are read alike, from its counter of them (``counters["graph_break"]``,
reason -> count, torch 2.6 to 2.15): what its counts grew by since the last step, and of that the breaks at a call of
``torch._dynamo.disable`` inside the compiled code, which is how FSDP2 keeps Dynamo out of its hooks (each hook is
wrapped in one as it is called): a model compiled whole after sharding breaks at its units' hooks (2 breaks for the
reference GPT on torch 2.13, 4 for a tiny HF Llama). Dynamo words that break differently in each version (2.6 "skip
function disable in file .../_dynamo/decorators.py", 2.13 "... the function `disable` in file
.../_dynamo/decorators.py ...", 2.15 "Call to `torch._dynamo.disable()`"); a break at a call of a function that
disable wrapped (2.6 "call torch._dynamo.disable() wrapped function <function f ...>", 2.13 and 2.15 "Skip calling
`torch.compiler.disable()`d function") counts where the function is FSDP's, not a user's own."""

from __future__ import annotations

import logging
import sys
from typing import Callable, Optional

from ..records import RecompileLimit
from . import fsdp2 as F2
from .log_tap import LoggerTap

#: Dynamo's outermost compile timers (the recorder clips their sum at the step's wall, should one run in the other)
COMPILE_KEYS = ("_compile.compile_inner", "backward._backward_impl")


def at_disable(reason: str) -> bool:
    """Dynamo's reason for a graph break says it broke where FSDP2 calls ``torch._dynamo.disable`` to run a hook (the
    module docstring)."""
    if "wrapped function" in reason or "disable()`d function" in reason:  # (a function disable wrapped: whose?)
        return "FSDP" in reason
    return "torch._dynamo.disable()" in reason or ("disable" in reason and "decorators.py" in reason)


class CompileClock:
    """The compiles since the last :meth:`take`, from Dynamo's timing table, and the graph breaks since the last
    :meth:`breaks`, from its counter."""

    def __init__(self) -> None:
        self._seen = dict.fromkeys(COMPILE_KEYS, 0)
        self._breaks: dict[str, int] = {}
        self.take()  # (what compiled before watch() is not the first step's)
        self.breaks()

    def take(self) -> tuple[int, float]:
        """Graphs compiled since the last call (frames, lazy backwards) and their time in ms."""
        utils = sys.modules.get("torch._dynamo.utils")
        table = getattr(utils, "compilation_time_metrics", None)
        if not isinstance(table, dict):
            return 0, 0.0
        n, secs = 0, 0.0
        for key in COMPILE_KEYS:
            times = table.get(key) or []
            seen = self._seen[key]
            if len(times) < seen:  # (torch._dynamo.reset() cleared the table)
                seen = 0
            n += len(times) - seen
            secs += sum(times[seen:])
            self._seen[key] = len(times)
        return n, secs * 1e3

    def breaks(self) -> tuple[int, int]:
        """(the graph breaks Dynamo counted since the last call, of them those at a call of torch._dynamo.disable)."""
        now = F2.dynamo_counters().get("graph_break")
        if not now:  # (none yet, or the counters cleared: torch._dynamo.reset(), a user's counters.clear())
            self._breaks = {}
            return 0, 0
        n = disabled = 0
        for reason, count in now.items():
            new = count - self._breaks.get(reason, 0)
            if new < 0:  # (cleared and counted again since)
                new = count
            n += new
            disabled += new if at_disable(str(reason)) else 0
        self._breaks = dict(now)
        return n, disabled

class RecompileLimitTap(LoggerTap):
    """Dynamo giving up on a frame at its recompile limit, while the doctor watches. Dynamo warns once per code
    object that hits it ("torch._dynamo hit config.recompile_limit (8)", its function and last reason) and from then
    on runs that code eagerly wherever its cache has no matching entry: the Llama decoder layers of a new-user trial,
    each compiled in place, recompiled once per layer (Dynamo guards on the layer's index), and past 8 layers every
    later one ran eager with nothing in the report to say so. A handler of the doctor's on Dynamo's logger (added at
    entry, removed when the doctor steps aside; the warning and Dynamo's other handlers are left as they are) takes
    each such warning, with the unit compiled in place whose compiled call was running (``current_unit()``: its
    name, or None); :meth:`take` hands them to the step record. Where this process's logging keeps Dynamo's
    warnings quiet (TORCH_LOGS, a logging config), the hits Dynamo counts (its ``counters["unimplemented"]``) that no
    warning came with are taken too, their function unknown. Nothing is read per call: one dict walk per step."""

    def __init__(self, current_unit: Callable[[], Optional[str]], fail: Callable[[str, BaseException], None]):
        super().__init__(logging.WARNING, F2.dynamo_logger)
        self._current, self._fail = current_unit, fail
        self._seen: list[RecompileLimit] = []
        self._counted = F2.dynamo_limit_hits()  # (hits before watch() are not this run's)

    def handle(self, record: logging.LogRecord) -> bool:  # (the training thread's compiles)
        try:
            hit = F2.recompile_limit_hit(record) if self.ours(record) else None
            if hit is not None:
                self._seen.append(RecompileLimit(**hit, module=self._current() or ""))
        except Exception as e:  # noqa: BLE001  (never into Dynamo's compile)
            self._fail("recompile limit tap", e)
        return False

    def take(self) -> list[RecompileLimit]:
        """The limits hit since the last call: each warning seen, then the hits Dynamo counted beyond them."""
        seen, self._seen = self._seen, []
        counted = F2.dynamo_limit_hits()
        for name, n in counted.items():
            new = n - self._counted.get(name, 0) - sum(h.limit_type == name for h in seen)
            seen += [RecompileLimit(limit_type=name, limit=F2.dynamo_limits().get(name)) for _ in range(new)]
        self._counted = counted
        return seen
