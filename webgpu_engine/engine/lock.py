"""A strictly FIFO asyncio lock (one per loaded model): requests are served in arrival order, one at a
time or, for a chat model with continuous batching, up to `capacity` at once.

asyncio.Lock lets a newcomer take a just-released lock before a woken waiter runs; here release hands
the lock directly to the oldest waiter, so arrival order is service order. Cancelling a waiter removes
it from the queue; a waiter cancelled just after being handed the lock passes it on.
The lock also keeps a running mean of how long it is held, so a full queue can say when to retry.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque


class FIFOLock:
    """`capacity` holders at once (1: a lock; a chat model with continuous batching admits
    max_num_sequences requests), the rest served in arrival order."""

    def __init__(self, name: str = "", capacity: int = 1):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.name, self.capacity = name, int(capacity)
        self._held = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._starts: deque[float] = deque()   # when the current holders took it (oldest first)
        self.mean_hold_s = 0.0         # exponential moving average over recent holders

    @property
    def locked(self) -> bool:
        """True when a newcomer would have to wait (every place is held)."""
        return self._held >= self.capacity

    @property
    def held(self) -> int:
        return self._held

    @property
    def queue_length(self) -> int:
        """Requests waiting (not counting the one holding the lock)."""
        return sum(1 for w in self._waiters if not w.done())

    def retry_after(self) -> int:
        """Whole seconds until the queue as it is now has likely drained (at least 1)."""
        return max(1, math.ceil(self.mean_hold_s * (self.queue_length + 1) / self.capacity))

    async def acquire(self) -> None:
        if self._held < self.capacity and not self._waiters:
            self._held += 1
            self._starts.append(time.monotonic())
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # We were handed the lock and then cancelled: give it to the next in line.
                self.release()
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        if self._held <= 0:
            raise RuntimeError(f"FIFOLock {self.name!r} released while not held")
        now = time.monotonic()
        held = now - self._starts.popleft()     # the oldest holder's time: a FIFO estimate
        self.mean_hold_s = held if self.mean_hold_s == 0.0 else 0.8 * self.mean_hold_s + 0.2 * held
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(True)   # the place moves to that waiter; the count stays
                self._starts.append(now)
                return
        self._held -= 1

    async def __aenter__(self) -> "FIFOLock":
        await self.acquire()
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()
