"""torch.compile's compile time in each step, read from Dynamo's own timing table.

Dynamo appends the seconds of each timed compile phase to ``torch._dynamo.utils.compilation_time_metrics`` (key ->
list), torch 2.6 to 2.13 alike. Two of its keys are the outermost compiles a training step runs into: a frame
compiled by Dynamo (``_compile.compile_inner``: the forward's graph, AOT autograd's backward compiled with it, a
recompile, compiled autograd's backward graph, a compiled ``optimizer.step``) and AOT autograd's backward compiled
lazily at the first backward (``backward._backward_impl``). The step's share is what those lists grew by since the
last step: two lengths read per step, nothing installed. Where Dynamo was never imported nothing compiled, and the
table is not imported for it.

Before this a recompile (a shape change at step 10 of a 2-rank run, each block compiled in place) read as
"compute +1595.8 ms in forward/backward/optimizer", kept in the step statistics (p99 1526.8 ms, cv 184%)."""

from __future__ import annotations

import sys

#: Dynamo's outermost compile timers (the recorder clips their sum at the step's wall, should one run in the other)
COMPILE_KEYS = ("_compile.compile_inner", "backward._backward_impl")


class CompileClock:
    """The compiles since the last :meth:`take`, from Dynamo's timing table."""

    def __init__(self) -> None:
        self._seen = dict.fromkeys(COMPILE_KEYS, 0)
        self.take()  # (what compiled before watch() is not the first step's)

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
