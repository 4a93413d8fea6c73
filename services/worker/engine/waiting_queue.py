"""The engine's waiting sequences: one FIFO per SLO class, read highest class first."""

import itertools
from collections import deque
from collections.abc import Iterator

from services.worker.engine.sequence import Sequence
from shared.schemas import SLO_CLASSES


class WaitingQueue:
    """Sequences not running, interactive before standard before batch, FCFS within a class.

    A preempted sequence goes back to the head of its class (``appendleft``): it arrived before
    everything queued behind it."""

    def __init__(self) -> None:
        self._classes: tuple[deque[Sequence], ...] = tuple(deque() for _ in SLO_CLASSES)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._classes)

    def __bool__(self) -> bool:
        return any(self._classes)

    def __iter__(self) -> Iterator[Sequence]:
        return itertools.chain(*self._classes)

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Sequence) and seq in self._classes[seq.rank]

    def append(self, seq: Sequence) -> None:
        self._classes[seq.rank].append(seq)

    def appendleft(self, seq: Sequence) -> None:
        self._classes[seq.rank].appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self._classes[seq.rank].remove(seq)
