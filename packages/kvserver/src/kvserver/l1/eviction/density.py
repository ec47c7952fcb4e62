"""Hit density per (class, age): expected hits per unit of space-time, from how long earlier objects
of the class waited for their next access.

In the spirit of LHD (Beckmann, Chen & Cidon, NSDI'18), with two changes that matter when the
cache is small next to its working set:

- Reuse ages are measured beyond eviction. An evicted key is remembered for a while (lhd.py's
  ghosts); if it is asked for again, that is a reuse at its full age. Keys that leave the ghost
  list unasked, and keys still waiting, are censored at their age. The survival curve is the
  Kaplan-Meier estimate over all of them, so a class that today is evicted at age 40 can learn that
  it would be read at age 90. (LHD learns only from ages its objects actually reached, and needs a
  share of "explorer" objects for that.)
- The density at age `a` is the best ratio over every horizon `h > a` of the hits gained by keeping
  the object until `h` to the space-time that costs: max over h of (F(h) - F(a)) / (L(h) - L(a)),
  with F the reuse probability by age and L the expected space-time (the sum of survival): the
  slope of the tangent from point a to the upper convex hull of the (L, F) curve. If keys were
  read again independently, at ages drawn from their class's distribution, keeping every key whose
  density is above a threshold (the one the cache's size sets) would be the best hold-time rule;
  evicting the lowest density first approximates it.

Ages are coarsened, `age >> shift`, into AGES bins, the last one holding every older age; `shift`
is the finest at which the last bin holds at most 2% of the reuse and censoring ages.
"""

from __future__ import annotations

AGES = 64  # coarse age bins; the last one holds every older age
DECAY = 0.9  # histogram weight kept per refresh: an estimate remembers the last ~10 refreshes
MIN_EVENTS = 32.0  # fewer (decayed) events than this in all: the coarsening stays as it is
PRIOR_CLASS = 128.0  # pseudo-objects at risk with the hazard of all classes, in every class and age
PRIOR_ALL = 2.0  # pseudo-objects at risk that are never read again, at every age of all classes
MAX_SHIFT = 40


class HitDensity:
    """Per-class age histograms of reuses and censorings, and the hit density they imply."""

    def __init__(self, classes: int, ages: int = AGES, decay: float = DECAY, shift: int = 0) -> None:
        self.classes, self.ages, self.decay, self.shift = classes, ages, decay, shift
        self.reuses = [[0.0] * ages for _ in range(classes)]
        self.censored = [[0.0] * ages for _ in range(classes)]
        self.octaves = [0.0] * 64  # every event by the bit length of its age: picks the shift
        # until the first refresh: older is worse in every class (LRU)
        self.density = [[1.0 / (1 + a) for a in range(ages)] for _ in range(classes)]
        self.frozen = False  # a calibrated estimator keeps its densities and its shift (tracesim's bounds)

    def bin(self, age: int) -> int:
        """The histogram bin of a coarse age (`age >> shift`)."""
        return age if age < self.ages else self.ages - 1

    def reuse(self, cls: int, age: int) -> None:
        """An object of the class was asked for again `age` ticks after its last access (a hit, or a
        ghost's)."""
        self.reuses[cls][min(age >> self.shift, self.ages - 1)] += 1.0  # bin(), inlined: every hit
        self.octaves[min(63, age.bit_length())] += 1.0

    def censor(self, cls: int, age: int) -> None:
        """An object of the class was last seen unasked `age` ticks after its last access (forgotten
        by the ghost list)."""
        self.censored[cls][self.bin(age >> self.shift)] += 1.0
        self.octaves[min(63, age.bit_length())] += 1.0

    def refresh(self, waiting: list[list[float]] | None = None) -> int:
        """Adapt the coarsening, recompute the densities and decay the histograms.

        `waiting`: per class, the age histogram of objects still waiting for their next access
        (resident or ghost): censored at their current age for this estimate only, so that a cache
        where few objects have left yet does not believe that everything is read again.

        Returns how much `shift` changed: the caller re-buckets what it keyed by coarse time. A
        frozen estimator only records (so it can be inspected) and returns 0.
        """
        if self.frozen:
            return 0
        step = self._adapt()
        if step and waiting is not None:  # binned at the old shift, like the histograms were
            for _ in range(abs(step)):
                waiting = [_rescaled(row, 1 if step > 0 else -1) for row in waiting]
        self.density = self.densities(waiting)
        for row in (*self.reuses, *self.censored, self.octaves):
            for a in range(len(row)):
                row[a] *= self.decay
        return step

    def densities(self, waiting: list[list[float]] | None = None) -> list[list[float]]:
        """Hit density of every (class, coarse age) from the histograms as they stand.

        Each class's hazard is shrunk toward that of all classes together where it has few
        objects at risk, and that one toward "never read again" where all classes have few.
        """
        censored = (
            self.censored
            if waiting is None
            else [[a + b for a, b in zip(row, extra)] for row, extra in zip(self.censored, waiting)]
        )
        pooled = hazard(
            [sum(col) for col in zip(*self.reuses)], [sum(col) for col in zip(*censored)], [0.0] * self.ages, PRIOR_ALL
        )
        return [density_curve(hazard(self.reuses[c], censored[c], pooled, PRIOR_CLASS)) for c in range(self.classes)]

    def frozen_copy(self, waiting: list[list[float]] | None = None) -> HitDensity:
        """An estimator at this shift whose densities are those of everything recorded here (and
        `waiting`), for good: it records what it sees but never refreshes (tracebounds.py)."""
        out = HitDensity(self.classes, self.ages, 1.0, self.shift)
        out.density = self.densities(waiting)
        out.frozen = True
        return out

    def coarsen(self) -> bool:
        """One step coarser whatever the histograms say (the caller keeps too many distinct coarse
        times); False when frozen or at the limit."""
        if self.frozen or self.shift >= MAX_SHIFT:
            return False
        self._rescale(1)
        self.density = self.densities()
        return True

    def _adapt(self) -> int:
        """The finest shift at which at most 2% of the events are older than the histogram's last
        bin (from the events' bit lengths); returns the change."""
        total = sum(self.octaves)
        if total < MIN_EVENTS:
            return 0
        target = 0
        while target < MAX_SHIFT:
            horizon = (self.ages - 1) << target
            # events of bit length k are at least 2 ** (k - 1) old
            older = sum(n for k, n in enumerate(self.octaves) if k and 1 << (k - 1) >= horizon)
            if older <= 0.02 * total:
                break
            target += 1
        step = target - self.shift
        for _ in range(abs(step)):
            self._rescale(1 if step > 0 else -1)
        return step

    def _rescale(self, step: int) -> None:
        self.shift += step
        for table in (self.reuses, self.censored):
            for i, row in enumerate(table):
                table[i] = _rescaled(row, step)


def _rescaled(row: list[float], step: int) -> list[float]:
    """A histogram at shift + step (+1 or -1): two bins merge into one, or one splits into two."""
    n = len(row)
    new = [0.0] * n
    for a, count in enumerate(row):
        if step > 0:
            new[a // 2] += count
        else:
            new[min(2 * a, n - 1)] += count / 2
            new[min(2 * a + 1, n - 1)] += count / 2
    return new


def hazard(reuses: list[float], censored: list[float], prior: list[float], weight: float) -> list[float]:
    """Kaplan-Meier hazard by age (reuses at the age over objects that reached it), with `weight`
    pseudo-objects of hazard `prior` at every age."""
    n = len(reuses)
    out = [0.0] * n
    at_risk = reuses[-1] + censored[-1]  # the last bin holds every older age: its rate per unit of
    for a in range(n - 2, -1, -1):  # age is unknown, so it claims none (0, like ages nobody reached)
        at_risk += reuses[a] + censored[a]
        out[a] = (reuses[a] + weight * prior[a]) / (at_risk + weight)
    return out


def density_curve(hazard: list[float]) -> list[float]:
    """density[a] = max over h > a of (F(h) - F(a)) / (L(h) - L(a)) (see the module docstring).

    F and L come from the survival S the hazard implies: F(x) = 1 - S(x), L(x) = S(0) + ... +
    S(x - 1). The maximum is the slope of the tangent from point a to the upper hull of the points
    right of it, kept while a walks left: O(AGES log AGES).
    """
    n = len(hazard)
    xs, ys = [0.0] * (n + 1), [0.0] * (n + 1)  # (L(x), F(x)) for x = 0..n
    s = 1.0
    for a in range(n):
        xs[a + 1] = xs[a] + s
        s *= 1.0 - hazard[a]
        ys[a + 1] = 1.0 - s
    out = [0.0] * n
    hull: list[int] = [n]  # upper hull of the points right of a, leftmost last
    for a in range(n - 1, -1, -1):
        # the tangent from a: slopes to hull points rise then fall from left to right
        lo, hi = 0, len(hull) - 1  # hull[hi] is leftmost; search the index with the largest slope
        while lo < hi:
            mid = (lo + hi) // 2
            if _slope(xs, ys, a, hull[mid]) >= _slope(xs, ys, a, hull[mid + 1]):
                hi = mid
            else:
                lo = mid + 1
        out[a] = max(0.0, _slope(xs, ys, a, hull[lo]))
        # add point a as the new leftmost one, dropping hull points that fall below the chord
        while len(hull) >= 2 and _slope(xs, ys, a, hull[-1]) <= _slope(xs, ys, hull[-1], hull[-2]):
            hull.pop()
        hull.append(a)
    return out


def _slope(xs: list[float], ys: list[float], i: int, j: int) -> float:
    dx = xs[j] - xs[i]
    return (ys[j] - ys[i]) / dx if dx > 1e-12 else 0.0
