"""Iteration-level scheduling: decodes keep running, waiting requests join while KV and budget allow."""

from collections import deque
from dataclasses import dataclass, field

from services.worker.engine.config import EngineConfig
from services.worker.engine.kv_cache import BlockManager
from services.worker.engine.lora_hook import LoraProvider
from services.worker.engine.sequence import Sequence, Status


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class BatchScheduler:
    """FCFS with preemption by recompute: when KV runs out mid-generation the newest sequence yields."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, adapters: LoraProvider | None = None):
        self.config = config
        self.blocks = blocks
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _resident(self, seq: Sequence) -> bool:
        """Refresh the sequence's adapter slot; False while its adapter is not resident."""
        adapter = seq.request.adapter
        if adapter is None or self.adapters is None:
            seq.slot = -1
            return adapter is None
        slot = self.adapters.slot_of(adapter)
        seq.slot = -1 if slot is None else slot
        return slot is not None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        kept: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            while not self.blocks.can_append(seq) and self.running:
                self._preempt(self.running.pop(), out)
            if not self.blocks.can_append(seq):
                self._preempt(seq, out)
                break
            kept.append(seq)
            if self._resident(seq):
                self.blocks.append(seq)
                out.decodes.append(seq)
        self.running = kept
        if not out.preempted:
            self._admit(out, budget=self.config.max_num_batched_tokens - len(out.decodes))
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Sequence] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._resident(seq):
                skipped.append(self.waiting.popleft())
                continue
            if seq.num_tokens > budget or not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            budget -= seq.num_new_tokens  # a cached prefix costs nothing this step
            self.running.append(seq)
            out.prefills.append(seq)
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free(seq)
        seq.preempt()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
