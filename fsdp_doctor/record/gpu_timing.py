"""Device-side unit timings on CUDA: events recorded at the same brackets as the host timings, read a
step later so that nothing ever synchronizes the step.

On a GPU the host runs ahead of the device, so host timestamps at FSDP's hooks measure when work was
*issued*. CUDA events recorded on the current stream at those hooks measure when the device *ran* it.
Events of step N are resolved at the end of a later step once ``Event.query()`` says they completed
(normally at step N+1); only ``flush()`` at exit waits for the last ones. Results are written as
``GpuTimes`` records, which readers attach to the step they belong to.

Besides the phases, each record times where the device stood outside the model: the idle from the previous
step's end event to this step's start (the doctor's bookkeeping at ``doctor.step()`` lies between them), from
the start to the first forward (a device waiting for the batch), and from the last phase's end to the step's end.
On CUDA the host's own ``outside_ms`` is no such measure: a loop that waits for the device once per step
(``loss.item()``, a pageable ``.to(device)``) spends the device's backlog there.

Each unit's own spans are timed on every ``UNIT_EVERY``-th step (from step 0); on the others only the outermost
spans are (the root unit's, or each top-level unit's where the root is none), which is what the phases need: an
event is a ~7 µs call on the H100, and four per unit each step were a third of the doctor's cost on a host-bound
1B-parameter model. Those steps' ``GpuTimes.units`` is empty.

This path needs a CUDA device: it is written against ``torch.cuda.Event`` and exercised by
``tests/test_gpu_timing.py``, which is skipped on machines without one (``tests/test_device_time.py`` drives its
bookkeeping on the CPU with stand-in events).
"""

from __future__ import annotations

from collections import deque

import torch

from ..records import GpuTimes


#: steps between two steps whose units are each timed (the phases are timed on every step)
UNIT_EVERY = 10


class GpuTimeline:
    def __init__(self, rank: int, n_units: int, names: list[str], unit_every: int = UNIT_EVERY):
        self.rank = rank
        self.names = names
        self.unit_every = max(1, unit_every)
        self._step = 0  # the step now running
        self._units_now = True  # this step times every unit's spans (else the outermost ones only)
        self._pool: list[torch.cuda.Event] = []
        self._spans: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []  # (unit, 0 fwd / 1 bwd, start, end)
        # spans open now: (unit, kind) -> start event (None: nested, untimed on this step)
        self._open: dict[tuple[int, int], torch.cuda.Event | None] = {}
        self._step_start: torch.cuda.Event | None = None
        self._prev_end: torch.cuda.Event | None = None  # the last step's end: the next step's idle is timed from it
        self._pending: deque = deque()
        # phases: forward = first unit forward opened .. last closed (kind 0), backward likewise (kind 1),
        # optimizer = the optimizer hook pair (kind 2)
        self._first: dict[int, torch.cuda.Event] = {}
        self._last: dict[int, torch.cuda.Event] = {}

    def _event(self) -> torch.cuda.Event:
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin_step(self) -> None:
        self._units_now = self._step % self.unit_every == 0
        self._step_start = self._event()

    def open(self, unit: int, kind: int) -> None:
        key = (unit, kind)
        if key in self._open:
            return
        # a span nested in an open one is timed only on a step that times every unit
        ev = self._event() if self._units_now or not self._nested(kind) else None
        self._open[key] = ev
        if ev is not None:
            self._first.setdefault(kind, ev)

    def close(self, unit: int, kind: int) -> None:
        key = (unit, kind)
        if key not in self._open:
            return
        start = self._open.pop(key)
        if start is None and self._nested(kind):
            return  # nested and untimed
        end = self._event()
        if self._units_now:
            if start is not None:
                self._spans.append((unit, kind, start, end))
        else:
            # only the phase's first start and last end are read: the others go back to the pool
            if start is not None and start is not self._first.get(kind):
                self._pool.append(start)
            if kind in self._last:
                self._pool.append(self._last[kind])
        self._last[kind] = end

    def _nested(self, kind: int) -> bool:
        """Whether a span of ``kind`` is open now (a new one would nest in it)."""
        return any(k == kind for _u, k in self._open)

    def optimizer_begin(self) -> None:
        if 2 not in self._first:
            self._first[2] = self._event()

    def optimizer_end(self) -> None:
        if 2 in self._first:
            self._last[2] = self._event()

    def end_step(self, step: int) -> list[GpuTimes]:
        """Closes the step (no wait) and returns the records of earlier steps whose events completed."""
        end = self._event()
        phases = {k: (self._first[k], self._last[k]) for k in self._first if k in self._last}
        self._pending.append((step, self._step_start, end, self._spans, phases, self._prev_end))
        self._prev_end = end  # back in the pool once the next step, which times its idle from it, is resolved
        self._spans = []
        self._first, self._last = {}, {}
        held = {id(ev) for pair in phases.values() for ev in pair}
        for ev in self._open.values():  # spans left open (a forward without backward): drop them
            if ev is not None and id(ev) not in held:  # ... unless a phase still needs it (not reused before read)
                self._pool.append(ev)
        self._open.clear()
        self._step = step + 1
        out = []
        while self._pending and self._pending[0][2].query():
            out.append(self._resolve(*self._pending.popleft()))
        return out

    def flush(self) -> list[GpuTimes]:
        out = []
        while self._pending:
            item = self._pending.popleft()
            item[2].synchronize()  # only at exit
            out.append(self._resolve(*item))
        return out

    def _resolve(self, step, start, end, spans, phases, prev_end) -> GpuTimes:
        phase_ms = {k: round(a.elapsed_time(b), 3) for k, (a, b) in phases.items()}
        last = next((phases[k][1] for k in (2, 1) if k in phases), None)  # the optimizer's end, else backward's
        fwd = [0.0] * len(self.names)
        bwd = [0.0] * len(self.names)
        for unit, kind, s, e in spans:
            (fwd if kind == 0 else bwd)[unit] += s.elapsed_time(e)
            self._pool += [s, e]
        in_spans = {id(ev) for _u, _k, s, e in spans for ev in (s, e)}
        self._pool += [ev for pair in phases.values() for ev in pair if id(ev) not in in_spans]  # untimed steps' too
        rec = GpuTimes(
            rank=self.rank, step=step, step_ms=round(start.elapsed_time(end), 3),
            units=[[n, round(f, 3), round(b, 3)] for n, f, b in zip(self.names, fwd, bwd)] if spans else [],
            forward_ms=phase_ms.get(0, 0.0), backward_ms=phase_ms.get(1, 0.0), optimizer_ms=phase_ms.get(2, 0.0),
            idle_before_ms=None if prev_end is None else round(prev_end.elapsed_time(start), 3),
            before_forward_ms=round(start.elapsed_time(phases[0][0]), 3) if 0 in phases else None,
            after_model_ms=None if last is None else round(last.elapsed_time(end), 3),
        )
        self._pool += [start] + ([prev_end] if prev_end is not None else [])
        return rec
