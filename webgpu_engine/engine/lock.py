"""A strictly FIFO asyncio lock (one per loaded model): requests run one at a time in arrival order.

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
    def __init__(self, name: str = ""):
        self.name = name
        self._locked = False
        self._waiters: deque[asyncio.Future] = deque()
        self._held_since = 0.0
        self.mean_hold_s = 0.0         # exponential moving average over recent holders

    @property
    def locked(self) -> bool:
        return self._locked

    @property
    def queue_length(self) -> int:
        """Requests waiting (not counting the one holding the lock)."""
        return sum(1 for w in self._waiters if not w.done())

    def retry_after(self) -> int:
        """Whole seconds until the queue as it is now has likely drained (at least 1)."""
        return max(1, math.ceil(self.mean_hold_s * (self.queue_length + 1)))

    async def acquire(self) -> None:
        if not self._locked and not self._waiters:
            self._locked = True
            self._held_since = time.monotonic()
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
        if not self._locked:
            raise RuntimeError(f"FIFOLock {self.name!r} released while not held")
        now = time.monotonic()
        held = now - self._held_since
        self.mean_hold_s = held if self.mean_hold_s == 0.0 else 0.8 * self.mean_hold_s + 0.2 * held
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(True)   # ownership moves to that waiter; stays locked
                self._held_since = now
                return
        self._locked = False

    async def __aenter__(self) -> "FIFOLock":
        await self.acquire()
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()
