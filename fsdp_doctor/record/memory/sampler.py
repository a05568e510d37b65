"""Which steps the memory probe measures in full, and the replay of the others.

Full steps measure every figure at every mark; on light steps a mark only notes when and where it happened (plus
the allocator total on CUDA) and takes the figures of the same mark of the last full step: FSDP's schedule
repeats. ``full_every="auto"`` sizes the period from the measured costs so that the probe stays within ``budget``
of the median step. One collaborator of :class:`fsdp_doctor.record.memory.MemoryProbe`.
"""

from __future__ import annotations

MAX_EVERY = 100
TMP = -1  # temporaries: the last category of a sample row


def _median(xs: list[int]) -> int:
    return sorted(xs)[len(xs) // 2]


class Sampler:
    def __init__(self, full_every, budget: float, is_cuda: bool):
        self.full_every = full_every  # "auto" or N
        self.budget = budget
        self.is_cuda = is_cuda
        self.every = 1  # current period of full steps
        self.next_full = 0
        self.last_full: list | None = None  # [(unit, phase, row)] of the last full step
        self.last_transients: dict[int, list] = {}  # mark index -> [(unit, phase, row)] high-waters after it
        self._light_ns: list[int] = []
        self._full_ns: list[int] = []
        self._last_step_end = 0
        self._walls: list[int] = []
        self._full_walls: list[int] = []  # wall times of full steps and of light ones (ns)
        self._light_walls: list[int] = []
        self._new_wall = False

    def is_full(self, step: int, traced: bool = False) -> bool:
        """Whether ``step`` is measured in full. A step inside a profiler window (``traced``) is not, once a full
        step exists: the memory high-water's dispatch mode runs every operator through Python, and the trace
        would time that instead of the user's step (its verdict and overlap with it). A full step due then comes
        at the first step after the window ("auto")."""
        if step >= 3 and traced and self.last_full is not None:
            return False
        every = self.full_every
        if every == "auto":
            return step < 3 or step >= self.next_full or self.last_full is None
        return step < 3 or step % every == 0 or self.last_full is None

    def step_wall(self, t_end: int) -> None:
        """The step ends at ``t_end`` (ns): its wall time feeds the budget."""
        if self._last_step_end:
            self._walls.append(t_end - self._last_step_end)
            self._new_wall = True
            if len(self._walls) > 64:
                del self._walls[:32]
        self._last_step_end = t_end

    def remember(self, samples, rows, transients=()) -> None:
        """A full step's marks and rows, and the high-waters between marks ``(after mark index, t, unit, phase,
        row)``, replayed by the light steps after it."""
        self.last_full = [(s[1], s[2], r) for s, r in zip(samples, rows)]
        self.last_transients = {}
        for i, _t, unit, phase, row in transients:
            self.last_transients.setdefault(i, []).append((unit, phase, row))

    def replay(self, samples, fallback) -> tuple[list, int, list]:
        """Light step: each mark takes the figures of the same mark of the last full step (same unit and
        phase at the same position); temporaries are this step's own (CUDA). ``fallback(tmp)`` is the row of
        a mark that does not line up; returns (rows, marks that did not line up, the full step's high-waters
        after the marks that lined up, as ``(after mark index, t, unit, phase, row)``)."""
        last = self.last_full or []
        rows = []
        extra = []
        bad = 0
        for i, (t, unit, phase, tmp) in enumerate(samples):
            if i < len(last) and last[i][0] == unit and last[i][1] == phase:
                r = list(last[i][2])
                if self.is_cuda:
                    known = sum(r) - r[TMP]
                    r[TMP] = max(0, tmp - known)
                rows.append(r)
                for unit_, phase_, row in self.last_transients.get(i, ()):
                    extra.append((i, t, unit_, phase_, list(row)))
            else:
                bad += 1
                rows.append(fallback(0))
        return rows, bad, extra

    def step_cost(self, step: int, full: bool, total_ns: int, mismatched: int) -> None:
        """The probe's cost this step; schedules the next full step."""
        (self._full_ns if full else self._light_ns).append(total_ns)
        if self._new_wall:
            (self._full_walls if full else self._light_walls).append(self._walls[-1])
            self._new_wall = False
        for lst in (self._full_ns, self._light_ns, self._full_walls, self._light_walls):
            if len(lst) > 64:
                del lst[:32]
        if mismatched:
            self.next_full = step + 1
        elif full and step >= 2:
            self._schedule(step)

    def _schedule(self, step: int) -> None:
        """full_every="auto": the next full step comes when the amortised probe cost (a full step's cost
        over the period, plus light steps) stays within ``budget`` of the median step time."""
        every = self.full_every
        if every != "auto":
            self.every = every
            return
        walls = sorted(self._walls[-20:])
        if not walls or not self._full_ns:
            return
        wall = walls[len(walls) // 2]
        full = _median(self._full_ns[-5:])
        if len(self._light_walls) >= 3 and len(self._full_walls) >= 3:
            # what a full step really costs the user: part of it (entering the high-water's dispatch mode for
            # every op) cannot be timed from inside the probe
            full = max(full, _median(self._full_walls[-5:]) - _median(self._light_walls[-20:]))
        light = sorted(self._light_ns[-20:])[len(self._light_ns[-20:]) // 2] if self._light_ns else full // 10
        room = self.budget * wall - light
        n = MAX_EVERY if room <= 0 else -(-int(full - light) // max(1, int(room)))
        self.every = max(1, min(MAX_EVERY, n))
        self.next_full = step + self.every
