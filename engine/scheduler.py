"""Continuous batching: which sequences run each step with how many tokens, and what happens to them after."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.spec_decode import Proposer, SpecState, SpecTrace, StepCost, accepted


@dataclass
class ScheduledBatch:
    """Sequences of one step with their token counts; decodes (one token) come first."""

    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int  # leading sequences attended as decodes: one token each, or a speculative one's several
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write, before the forward


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 proposer: Proposer | None = None, max_model_len: int = 1 << 62) -> None:  # fmt: skip
        self.bm, self.max_num_seqs, self.max_num_batched_tokens = block_manager, max_num_seqs, max_num_batched_tokens
        self.proposer, self.max_model_len = proposer, max_model_len
        self.step_cost = StepCost()  # decode steps' time by rows: what guesses cost (EngineCore records it)
        self.spec_steps = self.spec_draft_tokens = self.spec_accepted_tokens = 0  # speculation's counters
        self.spec_accepted_per_pos = [0] * (proposer.k if proposer else 0)  # kept guesses at each position
        self.guess_rates: dict[int, float] = {}  # per kind of guess, what every sequence's checks gave (SpecState)
        self.spec_trace: SpecTrace | None = None  # what checks did to the pool since the last snapshot (once taken)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.parked: OrderedDict[int, Sequence] = OrderedDict()  # idle conversations, oldest first
        self.preemptions = 0
        self.prefill_tokens = 0  # prompt tokens computed by prefill over the engine's life

    def add(self, seq: Sequence) -> None:
        self.parked.pop(seq.seq_id, None)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def park(self, seq: Sequence) -> None:
        self.bm.drop_pending(seq)
        seq.status = SequenceStatus.PARKED
        self.parked[seq.seq_id] = seq

    def remove(self, seq: Sequence) -> None:
        """Take seq out of every queue (finish, abort, drop); its blocks are the caller's business."""
        # Tolerant: after a failure mid-schedule a sequence may be marked WAITING yet in no queue.
        if seq.status is SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.seq_id, None)
        self.bm.drop_pending(seq)

    def _reclaim(self, protect: Sequence | None) -> bool:
        """Free some blocks: parked conversations oldest first, then waiting sequences that still
        hold blocks (newest first), then preempt the most recently admitted running sequence."""
        if self.parked:
            _, seq = self.parked.popitem(last=False)
            self.bm.free(seq)  # stays parked in its conversation with no blocks: recomputed next turn
            seq.status = SequenceStatus.PARKED
            return True
        for seq in reversed(self.waiting):
            if seq.block_table and seq is not protect:
                self.bm.free(seq)
                return True
        if self.running and self.running[-1] is not protect:
            self._preempt(self.running[-1])
            return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: keep the tokens, drop the KV; it resumes before anything newer.
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted_before = self.preemptions
        guesses = self._propose()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self.bm.can_append(seq, n) and self._reclaim(protect=seq):
                pass  # reclaim until seq fits or nothing is left to reclaim
            if self.bm.can_append(seq, n):  # _reclaim never touches seq or anything before it
                # a token left for each later one
                n += self._speculate(seq, n, budget - (len(self.running) - i - 1), guesses.get(seq.seq_id))
                self.bm.append_slots(seq, n)
                scheduled.append((seq, n))
                budget -= n
                i += 1
            else:  # nothing left to reclaim but seq itself
                self._preempt(seq)

        # Admit waiting prefills unless this step already had to preempt.
        deferred: list[Sequence] = []
        seats = sum(map(_seats, self.running))  # an admitted n > 1 group forks before its next step
        try:
            while (self.waiting and budget > 0 and self.preemptions == preempted_before
                   and seats + _seats(self.waiting[0]) <= self.max_num_seqs):  # fmt: skip
                seq = self.waiting[0]
                plan = self.bm.plan(seq)
                if plan.miss_hashes and plan.miss_hashes[0] in self.bm.pending:
                    # Its next block is being computed for another sequence (a shared system prompt
                    # arriving several times at once): wait a step and hit the cache instead.
                    deferred.append(self.waiting.popleft())
                    continue
                # Parked conversations give way to new work; when nothing runs that could free
                # memory later, waiting sequences holding blocks give way too. Re-plan after each
                # release: a released block may be one of seq's prefix-cache hits.
                while (plan.num_free_needed > self.bm.num_free_blocks
                       and (self.parked or not (self.running or scheduled))):  # fmt: skip
                    if not self._reclaim(protect=seq):
                        break
                    plan = self.bm.plan(seq)
                if plan.num_free_needed > self.bm.num_free_blocks:
                    break
                self.bm.allocate(seq, plan)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                seats += _seats(seq)
                n = min(seq.num_uncomputed, budget)
                scheduled.append((seq, n))
                budget -= n
        finally:  # deferred sequences go back in front, even if admission failed
            self.waiting.extendleft(reversed(deferred))
        scheduled.sort(key=lambda sn: not _decodes(*sn))  # decodes first, stable otherwise
        num_decodes = sum(1 for s, n in scheduled if _decodes(s, n))
        seqs, counts = [s for s, _ in scheduled], [n for _, n in scheduled]
        copies, self.bm.pending_copies = self.bm.pending_copies, []  # queued since the last batch
        return ScheduledBatch(seqs, counts, num_decodes, copies)

    def logit_rows(self, batch: ScheduledBatch) -> tuple[list[int], list[tuple[SequenceGroup, list[int], int]]
                                                            ] | None:  # fmt: skip
        """The token rows to take logits of, where a step needs more than each sampling sequence's last one:
        prompt positions due for logprobs first, then the rows that sample (every row of a speculative
        sequence), and per scored span its group, the tokens it scores and its first row. None otherwise."""
        scored, samples, spans, offset, speculating = [], [], [], 0, False
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start, group = seq.num_computed_tokens, seq.group
            if group.params.prompt_logprobs is not None:  # positions not scored yet (not again after a preemption)
                lo = len(group.prompt_logprobs) - 1
                hi = min(start + n, seq.num_prompt_tokens - 1)  # the last prompt position scores the reply
                if hi > lo:
                    assert start <= lo, "prompt positions were computed without their logits"
                    spans.append((group, seq.token_ids[lo + 1 : hi + 1], len(scored)))
                    scored += range(offset + lo - start, offset + hi - start)
            if seq.num_draft_tokens:  # every position of a speculative sequence samples
                samples += range(offset, offset + n)
                speculating = True
            elif start + n == len(seq):
                samples.append(offset + n - 1)
            offset += n
        return (scored + samples, spans) if spans or speculating else None

    def advance(self, batch: ScheduledBatch) -> tuple[list[int], list[Sequence]]:
        """Mark the batch's tokens computed; returns the sequences that sample now with their logits row. A group's
        first sample forks its n-1 siblings here: they share its prompt blocks and repeat its row."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            old = seq.num_computed_tokens
            seq.num_computed_tokens = old + n
            if not seq.num_draft_tokens:  # a speculative step's blocks: once its guesses are checked
                self.bm.cache_full_blocks(seq, old)
            group, prompt = seq.group, max(0, min(n, seq.num_prompt_tokens - old))
            group.prefilled_tokens += prompt
            self.prefill_tokens += prompt
            if seq.num_computed_tokens != len(seq):
                continue  # a prefill chunk short of the prompt's end: no logits
            if seq.num_draft_tokens:  # a row per position: its last token's and each guess's
                rows += range(row, row + n)
                seqs += [seq] * n
                row += n
                continue
            forks = [seq]
            if len(group.seqs) < group.params.n and seq.index == 0 and seq.num_output_tokens == 0:
                forks += [self._fork_sample(seq, i) for i in range(len(group.seqs), group.params.n)]
            rows += [row] * len(forks)
            seqs += forks
            row += 1
        return rows, seqs

    def _propose(self) -> dict[int, list[int]]:
        """The guesses of every decode that may guess this step, asked of the proposer at once (a draft model
        runs one batched forward per guess position); _speculate trims them to the step's budget and memory."""
        if self.proposer is None:
            return {}
        wanted = [(seq, k) for seq in self.running if (k := self._wanted(seq)) > 0]
        return self.proposer.propose_batch(wanted) if wanted else {}

    def _wanted(self, seq: Sequence) -> int:
        """Guesses seq may take this step before the token budget and memory (0: none)."""
        group = seq.group
        # a decode, not before its first sampled token: a prompt's last chunk may be one token, and a group forks
        # its n - 1 samples only there (advance)
        if (seq.num_uncomputed != 1 or not seq.num_output_tokens or group.grammar is not None
                or group.params.logprobs is not None):
            return 0
        if seq.spec is None:
            seq.spec = SpecState()
        if seq.spec.paused:
            return seq.spec.budget(self.proposer.k)  # 0, a step of the pause gone
        if (kind := self.proposer.kind(seq)) is None:
            return 0
        seq.spec.kind, rate = kind, seq.spec.rate_of(kind, self.guess_rates)
        k = min(seq.spec.budget(self.proposer.k, rate), group.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - len(seq) - 1)
        if k > 0 and kind not in seq.spec.rates:
            # its first guess of this kind: one, to learn its own rate (the others' is a prior: a chat's 4-grams
            # stood 56 % of the time, an edit's 90 %, and an edit judged by the chats' rate never guessed)
            return 1
        # a check that would lose at this kind's rate is not taken; the next step's guesses are judged anew
        return self.step_cost.worth(k, rate, len(self.running)) if k > 0 else 0

    def _speculate(self, seq: Sequence, n: int, budget: int, guesses: list[int] | None) -> int:
        """Append the guesses of a decoding sequence that fit the step's budget and memory; returns how many."""
        drafts = guesses[: budget - 1] if guesses and n == 1 else []
        if not drafts or not self.bm.can_append(seq, 1 + len(drafts)):
            return 0  # guesses never take memory from anything else
        seq.token_ids += drafts
        seq.num_draft_tokens = len(drafts)
        return len(drafts)

    def accept(self, seq: Sequence, sampled: list[int]) -> list[int]:
        """A speculative step's outcome for seq: the tokens to append (the guesses that stand, then the
        token sampled after them). The KV of rejected guesses is forgotten and the blocks that stood are
        published; then the guesses leave token_ids (they come back through append_token, which checks each)."""
        k = seq.num_draft_tokens
        keep = accepted(seq.token_ids[len(seq) - k :], sampled)
        old = seq.num_computed_tokens - k - 1  # before the step
        if self.spec_trace is not None:  # the blocks its guesses were written to, before any goes back
            self.spec_trace.checked(seq.block_tables, len(seq) - k, len(seq), self.bm.block_size, k - keep)
        self._rollback(seq, len(seq) - k + keep)  # its last token and the guesses kept are computed
        self.bm.cache_full_blocks(seq, old)
        del seq.token_ids[len(seq) - k :]
        seq.num_draft_tokens = 0
        seq.spec.record(k, keep, self.guess_rates)
        for pos in range(keep):
            self.spec_accepted_per_pos[pos] += 1
        self.spec_steps, self.spec_draft_tokens, self.spec_accepted_tokens = (
            self.spec_steps + 1, self.spec_draft_tokens + k, self.spec_accepted_tokens + keep)
        return sampled[: keep + 1]

    def _rollback(self, seq: Sequence, num_computed: int) -> None:
        returned = self.bm.rollback(seq, num_computed)
        if self.spec_trace is not None:
            self.spec_trace.returned(returned)

    def _fork_sample(self, seq: Sequence, index: int) -> Sequence:
        child = Sequence(seq.token_ids, seq.group, index)
        child.owner = seq.owner
        self.bm.fork(seq, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        seq.group.seqs.append(child)
        return child

    def append_token(self, seq: Sequence, token: int, eos_token_ids: set[int], max_model_len: int) -> str | None:
        """Append a sampled token; returns "stop" (EOS or a stop id), "length" or None. Nothing
        finishes here: a stop string (the output processor's) still beats "length" on this token."""
        group, p = seq.group, seq.group.params
        if group.first_token_time is None:
            group.first_token_time = time.monotonic()
        seq.token_ids.append(token)
        if not p.ignore_eos and token in eos_token_ids or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str, park: bool) -> None:
        """seq is done: parked with its blocks for its conversation's next turn, or released."""
        seq.finish_reason, seq.finish_time = reason, time.monotonic()
        if seq.num_computed_tokens >= len(seq):  # stopped on a kept guess: the tokens after it are not its
            self._rollback(seq, len(seq) - 1)
        if park:
            self.remove(seq)
            self.park(seq)
        else:
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Drop seq and its blocks for good (a dropped conversation, a failed request)."""
        if seq.num_draft_tokens:  # a failed step's (or failed sibling's) unchecked guesses are not output
            del seq.token_ids[len(seq) - seq.num_draft_tokens :]
            seq.num_draft_tokens = 0
        self.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED


def _decodes(seq: Sequence, n: int) -> bool:
    """Attended as decodes: one new token, or a speculative sequence's last token and guesses."""
    return n == 1 or seq.num_draft_tokens > 0


def _seats(seq: Sequence) -> int:
    """Running places seq takes once admitted: itself, plus the samples its group forks at its first token."""
    group = seq.group
    if group is None or seq.index != 0 or seq.num_output_tokens:
        return 1
    return 1 + group.params.n - len(group.seqs)
