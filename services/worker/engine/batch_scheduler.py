"""Iteration-level scheduling: decodes keep running, waiting requests join while KV and budget allow."""

from collections import Counter
from dataclasses import dataclass, field

from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.kv_cache import BlockManager
from services.worker.engine.lora_hook import LoraProvider
from services.worker.engine.sequence import Sequence, Status
from services.worker.engine.waiting_queue import WaitingQueue


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class BatchScheduler:
    """FCFS within an SLO class, the higher class first, with preemption by recompute.

    Waiting sequences are admitted interactive first, then standard, then batch, while KV blocks,
    sequence slots and the token budget allow. When KV runs out mid-generation the lowest class
    yields, its newest sequence first. A waiting sequence kept out for ``class_preempt_after_steps``
    steps preempts running sequences of lower classes when their room lets it in; never one of its
    own class or above. With every request of one class this is plain FCFS, the newest yielding.

    Tenants share the KV blocks: while another tenant's request waits (its adapter resident), a request
    that would take its tenant's running requests past ``tenant_kv_share`` of the blocks is deferred and
    those behind it are admitted; a tenant with nothing running is never deferred, so nobody starves.
    """

    def __init__(self, config: EngineConfig, blocks: BlockManager, adapters: LoraProvider | None = None):
        self.config = config
        self.blocks = blocks
        self.adapters = adapters
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # highest class first, in admission order within a class
        self.steps = 0

    def add(self, seq: Sequence) -> None:
        seq.waiting_since = self.steps
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
        self.steps += 1
        out = SchedulerOutput()
        self.running.sort(key=lambda seq: seq.rank)  # stable: admission order stays within a class
        self._preempt_for_waiting(out)
        if self._decode(out):
            self._admit(out, budget=self.config.max_num_batched_tokens - len(out.decodes))
        return out

    def _decode(self, out: SchedulerOutput) -> bool:
        """Give every running sequence room for its next token; False when KV ran out on the way."""
        kept: list[Sequence] = []
        enough = True
        while self.running:
            seq = self.running.pop(0)
            while not self.blocks.can_append(seq) and self.running:
                self._preempt(self.running.pop(), out)  # the lowest class, its newest sequence
                enough = False
            if not self.blocks.can_append(seq):
                self._preempt(seq, out)
                enough = False
                break
            kept.append(seq)
            if self._resident(seq):
                self.blocks.append(seq)
                out.decodes.append(seq)
        self.running = kept
        return enough

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Preempt lower-class sequences, and those of another tenant holding more than its KV share, for
        the first waiting one once it has waited its delay, and only when the room they free lets it in:
        each preemption costs a recompute."""
        delay = self.config.class_preempt_after_steps
        held, waiting = self._held(), self._waiting_tenants()
        seq = next((s for s in self.waiting if self._resident(s) and not self._over_share(s, held, waiting)), None)
        if delay is None or seq is None or self.steps - seq.waiting_since < delay:
            return
        staying = list(self.running)
        if self._fits(seq, staying, freed=0):
            return  # no help needed: it is admitted below
        victims: list[Sequence] = []
        freed, share = 0, self._share_blocks()
        for victim in reversed(self.running):  # the lowest class first, its newest first
            tenant = victim.request.tenant
            over = tenant is not None and tenant != seq.request.tenant and held[tenant] > share
            if victim.rank < seq.rank or (victim.rank == seq.rank and not over):  # never a higher class
                continue
            staying.remove(victim)
            victims.append(victim)
            held[tenant] -= len(victim.block_table)
            freed += self.blocks.freeable(victim)
            if self._fits(seq, staying, freed):
                for victim in victims:
                    self.running.remove(victim)
                    self._preempt(victim, out)
                return

    def _fits(self, seq: Sequence, staying: list[Sequence], freed: int) -> bool:
        """Whether ``seq`` is admitted beside ``staying`` once ``freed`` more blocks are free."""
        c = self.config
        if len(staying) >= c.max_num_seqs or seq.num_tokens > c.max_num_batched_tokens - len(staying):
            return False
        growth = sum(self.blocks.growth(s) for s in staying)  # their next tokens are placed first
        return self.blocks.shortfall(seq) + growth <= freed

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        held, waiting = self._held(), self._waiting_tenants()
        for seq in list(self.waiting):  # the highest class first, FCFS within it
            if len(self.running) >= self.config.max_num_seqs:
                break
            if not self._resident(seq):
                continue  # waits for its adapter; who comes next is not held up by it
            if self._over_share(seq, held, waiting):
                continue  # waits for its tenant's running requests; other tenants' come first
            if seq.num_tokens > budget or not self.blocks.can_allocate(seq):
                break
            self.waiting.remove(seq)
            self.blocks.allocate(seq)
            held[seq.request.tenant] += len(seq.block_table)
            waiting[seq.request.tenant] -= 1
            seq.status = Status.RUNNING
            budget -= seq.num_new_tokens  # a cached prefix costs nothing this step
            self.running.append(seq)
            out.prefills.append(seq)

    def _held(self) -> Counter[str | None]:
        """KV blocks each tenant's running sequences hold (a shared prefix block counts for each)."""
        held: Counter[str | None] = Counter()
        for seq in self.running:
            held[seq.request.tenant] += len(seq.block_table)
        return held

    def _share_blocks(self) -> int:
        """The KV blocks one tenant may hold while another's request waits (every block: no share)."""
        return int(self.config.tenant_kv_share * self.blocks.allocator.num_blocks)

    def _waiting_tenants(self) -> Counter[str | None]:
        """Waiting sequences ready to run (adapter resident) by tenant."""
        return Counter(s.request.tenant for s in self.waiting if self._resident(s))

    def _over_share(self, seq: Sequence, held: Counter[str | None], waiting: Counter[str | None]) -> bool:
        """Whether admitting ``seq`` now takes its tenant past its KV share while another tenant waits."""
        tenant = seq.request.tenant
        if tenant is None or not held[tenant]:
            return False
        if held[tenant] + self.blocks.blocks_needed(seq.num_tokens) <= self._share_blocks():
            return False
        return any(count > 0 for other, count in waiting.items() if other != tenant)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free(seq)
        seq.preempt()
        seq.waiting_since = self.steps
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
