"""A strictly FIFO asyncio lock (one per loaded model): requests run one at a time in arrival order.

asyncio.Lock lets a newcomer take a just-released lock before a woken waiter runs; here release hands
the lock directly to the oldest waiter, so arrival order is service order. Cancelling a waiter removes
it from the queue; a waiter cancelled just after being handed the lock passes it on.
"""
from __future__ import annotations

import asyncio
from collections import deque


class FIFOLock:
    def __init__(self, name: str = ""):
        self.name = name
        self._locked = False
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def locked(self) -> bool:
        return self._locked

    @property
    def queue_length(self) -> int:
        """Requests waiting (not counting the one holding the lock)."""
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> None:
        if not self._locked and not self._waiters:
            self._locked = True
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
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(True)   # ownership moves to that waiter; stays locked
                return
        self._locked = False

    async def __aenter__(self) -> "FIFOLock":
        await self.acquire()
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()
