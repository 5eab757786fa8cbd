"""Which requests hold cache slots, and which wait for one (first come, first served)."""

from __future__ import annotations

import heapq
from collections import deque

from engine.request import Request, Status


class Scheduler:
    def __init__(self, slots: int):
        self.free_slots = list(range(slots))  # a heap: the lowest slot first keeps running slots contiguous
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots, oldest first."""
        admitted = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            request.slot = heapq.heappop(self.free_slots)
            request.status = Status.RUNNING
            self.running[request.slot] = request
            admitted.append(request)
        return admitted

    def release(self, request: Request) -> None:
        if request.status is Status.RUNNING:
            del self.running[request.slot]
            heapq.heappush(self.free_slots, request.slot)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.slot = None

    def decoding(self) -> list[Request]:
        """Running requests in slot order."""
        return [self.running[slot] for slot in sorted(self.running)]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
