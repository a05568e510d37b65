"""Which steps the memory probe measures in full, and the replay of the others.

Full steps measure every figure at every mark; on light steps a mark only notes when and where it happened and
takes the figures of the same mark of the last full step: FSDP's schedule repeats. On CUDA a light step also
reads the allocator's total, at a few marks only (``reads_at``): the first and the last, and the ``PEAK_READS``
marks (and high-waters between marks) that came closest to the last full step's peak. A read mark's temporaries
are its own (allocated - the named categories); every other mark's are the full step's, shifted by what the last
read mark found more or less than the full step there (a tensor the loop now keeps, say). Reading the allocator
is a ~40 µs Python call inside a step on the H100 (``torch.cuda.memory_stats_as_nested_dict``): at all ~90 marks
of a 20-unit model it cost 4-5 ms a step, the doctor's whole overhead on a host-bound step.
``full_every="auto"`` sizes the period from the measured costs so that the probe stays within ``budget`` of the
median step. One collaborator of :class:`fsdp_doctor.record.memory.MemoryProbe`.
"""

from __future__ import annotations

#: the longest period of full steps ("auto"): a full step of the 1B-parameter model cost 165 ms on the H100, every
#: 100 steps 1% of its 156 ms step; light steps read the allocator at the peak's marks, so the peak stays measured
MAX_EVERY = 512
TMP = -1  # temporaries: the last category of a sample row
#: marks a light step reads the allocator at, besides the first and the last: those nearest the full step's peak
PEAK_READS = 4
UNREAD = -1  # a light step's mark that did not read the allocator


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
        self.reads_at: frozenset[int] = frozenset()  # light steps' marks that read the allocator (CUDA)
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
        row)``, replayed by the light steps after it; on CUDA, which marks those steps read the allocator at."""
        self.last_full = [(s[1], s[2], r) for s, r in zip(samples, rows)]
        self.last_transients = {}
        for i, _t, unit, phase, row in transients:
            self.last_transients.setdefault(i, []).append((unit, phase, row))
        if not self.is_cuda or not rows:
            self.reads_at = frozenset()
            return
        # a high-water between marks i and i+1 is anchored at mark i: its height is read there
        height = {i: sum(r) for i, r in enumerate(rows)}
        for i, _t, _u, _p, row in transients:
            height[i] = max(height[i], sum(row))
        top = sorted(height, key=height.__getitem__, reverse=True)[:PEAK_READS]
        self.reads_at = frozenset({0, len(rows) - 1, *top})

    def replay(self, samples, fallback) -> tuple[list, int, list]:
        """Light step: each mark takes the figures of the same mark of the last full step (same unit and
        phase at the same position). On CUDA the temporaries of a mark that read the allocator are this step's
        own, and every other mark's (and every high-water's) are the full step's shifted by the difference the
        last read mark found. ``fallback(tmp)`` is the row of a mark that does not line up; returns (rows, marks
        that did not line up, the full step's high-waters after the marks that lined up, as ``(after mark index,
        t, unit, phase, row)``)."""
        last = self.last_full or []
        rows = []
        extra = []
        bad = 0
        shift = 0  # this step's allocator total less the full step's, at the last mark read
        cuda = self.is_cuda
        for i, (t, unit, phase, alloc) in enumerate(samples):
            if i < len(last) and last[i][0] == unit and last[i][1] == phase:
                full = last[i][2]
                if cuda and alloc != UNREAD:
                    r = list(full)
                    r[TMP] = max(0, alloc - (sum(r) - r[TMP]))
                    shift = r[TMP] - full[TMP]
                elif shift:
                    r = list(full)
                    r[TMP] = max(0, r[TMP] + shift)
                else:
                    r = full  # shared with the full step's row: nobody writes to it
                rows.append(r)
                for unit_, phase_, row in self.last_transients.get(i, ()):
                    row = list(row)
                    row[TMP] = max(0, row[TMP] + shift)
                    extra.append((i, t, unit_, phase_, row))
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
        # a power of two, the next full step at its next multiple: every rank counts at the same steps (each sizes
        # its own period; a longer one's steps are among a shorter one's), and the steps the step statistics leave out
        # are the same on every rank. Counted where each rank's period took it, a 16-rank run's ranks left out 1-2
        # steps each, 10 of 14 steps in all: 4 steps common to every rank, under the 5 a straggler is judged on, and
        # its 4 slow ranks went unnamed.
        self.every = min(MAX_EVERY, 1 << max(0, n - 1).bit_length())
        self.next_full = (step // self.every + 1) * self.every
