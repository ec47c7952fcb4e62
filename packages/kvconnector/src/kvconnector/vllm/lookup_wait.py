"""How long vLLM's scheduler waits for a lookup's answer before it tells vLLM "ask again later".

Both choices cost something. A wait halts the engine's step loop, so every running request's next
token is late by the wait. "Ask again later" makes vLLM skip the new request for a whole step, so its
first token is late by a step. On a busy host a round trip to the server often takes longer than a
fixed short wait, so many requests would lose a step. The wait therefore grows with the step: at
most `share` of a recent busy step, never below `floor_s`, never above `cap_s`. When no request of
the engine runs, a wait halts nobody and "ask again later" would only make vLLM run empty steps until
the answer came (every one of them a trip through its scheduler and model runner): then the wait is
`idle_s`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class LookupWait:
    """The wait for one lookup's answer, from the period of the engine's recent busy steps."""

    floor_s: float  # lookup_wait_s: always wait this long
    share: float  # lookup_wait_step_share: of a recent busy step
    cap_s: float  # lookup_wait_max_s
    idle_s: float = 0.0  # lookup_wait_idle_s: when no request of the engine runs
    alpha: float = 0.2  # weight of the newest step in the moving average
    period_s: float | None = field(default=None, init=False)  # moving average of busy steps' periods
    _last_t: float | None = field(default=None, init=False)
    _last_busy: bool = field(default=False, init=False)

    def step(self, now: float, busy: bool) -> None:
        """vLLM scheduled a step at `now` (monotonic); `busy`: it computes something. The time from a
        busy step to the next one is that step's period; after an idle step the engine may have
        slept, so that gap says nothing about a step's length."""
        if self._last_t is not None and self._last_busy:
            dt = max(0.0, now - self._last_t)
            self.period_s = dt if self.period_s is None else self.period_s + self.alpha * (dt - self.period_s)
        self._last_t, self._last_busy = now, busy

    def seconds(self, idle: bool = False) -> float:
        """`idle`: no request of the engine runs, so a wait halts nobody; the longer `idle_s` then
        spares the empty steps vLLM would run until the answer came."""
        if idle:
            return max(self.floor_s, self.idle_s)
        if self.period_s is None:
            return self.floor_s
        return max(self.floor_s, min(self.cap_s, self.share * self.period_s))
