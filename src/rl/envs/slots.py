"""How many rollouts are in flight: the one count training's and eval's groups share (`rollouts_in_flight`, or the
adaptive cap, which moves it; eval alone: `max_concurrent`), taken a group at a time, as an env server runs a group's
episodes together (rl/envs/groups.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class RolloutSlots:
    """At most `capacity` rollouts in flight. A group takes its n slots at once (all of them where n is more), in the
    order groups asked, so that two groups never each hold part of what the other waits for."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"rollouts in flight must be at least 1, not {capacity}")
        self.capacity = self.free = capacity
        self.waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def resize(self, capacity: int) -> None:
        """Allow `capacity` rollouts from now (the adaptive cap moves it): those holding slots keep them; while more
        than that hold slots, no group waiting starts."""
        if capacity < 1:
            raise ValueError(f"rollouts in flight must be at least 1, not {capacity}")
        self.free += capacity - self.capacity
        self.capacity = capacity
        self._hand_on()

    @contextlib.asynccontextmanager
    async def take(self, n: int) -> AsyncIterator[None]:
        n = min(n, self.capacity)
        await self._acquire(n)
        try:
            yield
        finally:
            self.free += n
            self._hand_on()

    async def _acquire(self, n: int) -> None:
        if not self.waiting and self.free >= n:
            self.free -= n
            return
        granted = asyncio.get_running_loop().create_future()
        self.waiting.append((n, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as it was cancelled: handed on
                self.free += n
            else:
                self.waiting.remove((n, granted))
            self._hand_on()
            raise

    def _hand_on(self) -> None:
        while self.waiting and self.waiting[0][0] <= self.free:
            n, granted = self.waiting.popleft()
            self.free -= n
            granted.set_result(None)
