"""Fair admission order: waiting requests grouped by the client request they came with, served
round-robin (the scheduler admits from it)."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from blockspec.engine.request import Request


def group_of(req: Request) -> object:
    """The client request ``req`` came with (a request without one is its own group)."""
    return req.group if req.group is not None else ("rid", req.rid)


class FairQueue:
    """Waiting requests: one FIFO per group (the client request they came with), served
    round-robin, so a request of a thousand prompts is admitted a share at a time and a small
    one beside it is next in line, not behind all of them."""

    def __init__(self) -> None:
        self._groups: OrderedDict[object, deque[Request]] = OrderedDict()
        self._n = 0

    def append(self, req: Request) -> None:
        self._groups.setdefault(group_of(req), deque()).append(req)
        self._n += 1

    def appendleft(self, req: Request) -> None:
        """First in line of all (a request being computed again resumes at once)."""
        self.requeue(req)
        self._groups.move_to_end(group_of(req), last=False)

    def requeue(self, req: Request) -> None:
        """First of its group, its group keeping its turn (a preempted request)."""
        self._groups.setdefault(group_of(req), deque()).appendleft(req)
        self._n += 1

    def heads(self) -> list[Request]:
        """The first request of every group, in turn order."""
        return [queue[0] for queue in self._groups.values()]

    def take(self, req: Request) -> None:
        """Admit ``req`` (the head of its group): that group's turn goes to the back."""
        key = group_of(req)
        queue = self._groups[key]
        assert queue[0] is req
        queue.popleft()
        self._n -= 1
        if queue:
            self._groups.move_to_end(key)
        else:
            del self._groups[key]

    def popleft(self) -> Request:
        """The next request of the group whose turn it is."""
        req = next(iter(self._groups.values()))[0]
        self.take(req)
        return req

    def remove(self, req: Request) -> None:
        key = group_of(req)
        queue = self._groups[key]
        queue.remove(req)
        self._n -= 1
        if not queue:
            del self._groups[key]

    def groups(self) -> list[object]:
        return list(self._groups)

    def __contains__(self, req: object) -> bool:
        queue = self._groups.get(group_of(req)) if isinstance(req, Request) else None
        return queue is not None and any(r is req for r in queue)

    def __iter__(self) -> Iterator[Request]:
        for queue in list(self._groups.values()):
            yield from list(queue)

    def __len__(self) -> int:
        return self._n
