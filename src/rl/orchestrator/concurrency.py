"""How many rollouts run at once, set by the engines' own load (as prime-rl's adaptive concurrency does).

Too few rollouts in flight leave the engines idle; too many fill vLLM's KV cache, which then preempts requests and
computes them again, and tokens/s falls. The right number moves with episode lengths, turns and the model, so a
controller reads each server's `/metrics` every `interval_s` and moves the cap the continuous dispatcher follows:

- grow (x `1 + grow`) while the cap is what limits the rollouts in flight, the fullest server's KV cache is below
  `kv_grow_below` and no request waits: the engines have room for more;
- trim softly (x `trim`) at the high-water mark `kv_high`, or while requests wait and their queue grows: no new
  group starts until those in flight fall below the cap;
- trim too (x `trim`) once the oldest group in flight has used `age_high` of `max_off_policy_steps` (steps since it
  started): episodes waiting on tools hold no KV cache, so the engines' load alone would let the cap grow until
  every episode is slow and the long ones outlive the bound, untrained;
- cut hard (x `cut` of what is in flight, `cut_again` where overload outlived the last cut's drain) on a
  preemption; with `shed`, the youngest groups beyond the cap are cancelled at once and run again later;
- while the groups in flight drain down to a lower cap, the engines' load still shows what ran before it: no
  further cut until they have (as prime-rl's controller waits);

never below `min_rollouts` nor above `max_rollouts`. Servers without vLLM's statistics give nothing to read: the cap
then stays where it is, said once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rl.orchestrator.engine_metrics import Scrape, scrape_of


@dataclass
class Decision:
    cap: int  # rollouts in flight allowed from now
    why: str  # grow, trim, cut, hold, or no metrics
    cancel: bool = False  # a hard cut: cancel the youngest groups beyond the cap now


@dataclass
class Load:
    """The engines' state over all servers of the pool at one reading."""

    kv_usage: float  # the fullest server's
    waiting: float
    preempted: float  # since the last reading


class ConcurrencyController:
    """One owner of the pool's in-flight cap (rollouts, a multiple of the group size `group`)."""

    def __init__(self, config, start: int, group: int):
        self.config, self.group = config, group
        self.floor = max(group, config.min_rollouts or group)
        self.ceiling = max(group, config.min_rollouts or group, config.max_rollouts or 4 * start)
        self.cap = self.bounded(start)
        self.last_counters: dict[int, float] = {}  # each server's preemptions at the last reading
        self.last_waiting = 0.0
        self.cut_last = False  # the last cut has not been followed by a reading without overload

    def bounded(self, rollouts: float) -> int:
        """`rollouts` within the floor and the ceiling, in whole groups."""
        groups = int(min(max(rollouts, self.floor), self.ceiling)) // self.group
        return max(groups * self.group, self.floor)

    def load(self, texts: list[str | Scrape | None]) -> Load | None:
        """The pool's load from each server's /metrics text (None: it did not answer); None where none holds vLLM's
        statistics. A server whose counter went down restarted: its preemptions count from zero."""
        scrapes = {i: s for i, text in enumerate(texts)
                   if (s := scrape_of(text) if isinstance(text, str) else text) is not None}
        if not any("kv_cache_usage" in s.gauges for s in scrapes.values()):
            return None
        preempted = 0.0
        for i, scrape in scrapes.items():
            now = scrape.counters.get("preemptions", 0.0)
            before = self.last_counters.get(i, now)
            preempted += now - before if now >= before else now
            self.last_counters[i] = now
        return Load(max(s.gauges.get("kv_cache_usage", 0.0) for s in scrapes.values()),
                    sum(s.gauges.get("requests_waiting", 0.0) for s in scrapes.values()), preempted)

    def update(self, texts: list[str | Scrape | None], in_flight: int, age: float = 0.0) -> Decision:
        """The cap from the servers' /metrics now, given the rollouts in flight and the share of
        max_off_policy_steps the oldest group in flight has used (`age`)."""
        load = self.load(texts)
        if load is None:
            return Decision(self.cap, "no metrics")
        decision = self.decide(load, in_flight, age)
        self.last_waiting = load.waiting
        self.cap = decision.cap
        return decision

    def decide(self, load: Load, in_flight: int, age: float = 0.0) -> Decision:
        c = self.config
        if in_flight > self.cap:  # draining to a lower cap: the load still shows what ran before it
            return Decision(self.cap, "drain")
        if load.preempted > 0:
            factor = c.cut_again if self.cut_last else c.cut  # overload that outlived a drain: cut harder
            self.cut_last = True
            return Decision(self.bounded(max(in_flight, self.floor) * factor), "cut", cancel=c.shed)
        if load.kv_usage >= c.kv_high or (load.waiting > 0 and load.waiting > self.last_waiting):
            return Decision(self.bounded(max(in_flight, self.floor) * c.trim), "trim")
        self.cut_last = False
        if age > c.age_high:  # more in flight would only slow each episode: the slowest would outlive the bound
            return Decision(self.bounded(max(in_flight, self.floor) * c.trim), "age")
        limited = in_flight + self.group > self.cap  # no further group fits under the cap
        if limited and load.kv_usage < c.kv_grow_below and load.waiting == 0:
            return Decision(self.bounded(max(self.cap * (1 + c.grow), self.cap + self.group)), "grow")
        return Decision(self.cap, "hold")

    def describe(self) -> str:
        c = self.config
        return (f"{self.cap} rollouts in flight to start, between {self.floor} and {self.ceiling} as the servers' "
                f"load says (read every {c.interval_s:g} s; KV high-water mark {c.kv_high:g}, grows below "
                f"{c.kv_grow_below:g}; trimmed once the oldest group in flight used {c.age_high:g} of the age bound)")



class AdaptiveCap:
    """The controller's loop: every `interval_s`, the run's in-flight count (the dispatcher's slots, shared with eval)
    from the servers' /metrics (`metrics()`, a text or None per server), and what it shed since the last
    step's record."""

    def __init__(self, controller: ConcurrencyController, dispatcher, metrics: Callable[[], Awaitable[list]],
                 log: Callable[[str], None], warn: Callable[[str], None]):
        self.controller, self.dispatcher, self.metrics, self.log, self.warn = controller, dispatcher, metrics, log, warn
        self.shed = 0  # rollouts cancelled by the cap since the last step's record
        self.task: asyncio.Future | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        controller, n = self.controller, self.controller.group
        self.log(f"concurrency: {controller.describe()}")
        said_blind = False
        while True:
            await asyncio.sleep(controller.config.interval_s)
            decision = controller.update(await self.metrics(), len(self.dispatcher.running) * n,
                                         self.dispatcher.age_used())
            if decision.why == "no metrics" and not said_blind:
                self.warn(f"concurrency: no server publishes vLLM's statistics (inference.log_stats); the cap stays "
                          f"at {decision.cap} rollouts until one does")
            said_blind = decision.why == "no metrics"
            shed = self.dispatcher.resize(decision.cap, shed=decision.cancel) * n
            self.shed += shed
            if decision.cancel:
                self.log(f"concurrency: a server preempted requests: cap {decision.cap} rollouts, the {shed} youngest "
                         "in flight cancelled to run again")

    def stats(self) -> dict:
        """The cap and what it shed since the last call; the loop's error, raised here rather than lost with it."""
        if self.task is not None and self.task.done():
            self.task.result()
        shed, self.shed = self.shed, 0
        return {"concurrency/cap": self.controller.cap, "concurrency/shed": shed}

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

