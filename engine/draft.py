"""Speculative decoding with a draft model: a smaller model with the target's vocabulary guesses k tokens greedily.

The draft keeps its own paged KV (a second, small pool: its own BlockManager and ModelRunner), one draft
sequence per target sequence, holding the target's accepted tokens. Each step it catches up on the tokens the
target accepted since the last step (a short prefill; after rejected guesses, its KV is first rolled back to
what the target kept) and then decodes k tokens, all sequences batched: k forwards per step, the first one
mixing catch-up prefills and decodes. A guess is the draft's argmax, a fixed token given the accepted tokens,
so the target's check (spec_decode.py, Scheduler.accept) keeps greedy output identical and sampled output
the target's: a row's draw equals a fixed guess with the target's probability, and one that differs is the
target's own draw given that it differs (rejection sampling with a one-token proposal).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.block_manager import BlockManager, cdiv
from engine.kv_groups import KVLayout
from engine.model_runner import ModelRunner
from engine.sampler import argmax
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode import NgramProposer, Proposer, SpeculativeConfig
from engine.weights.loader import LoadedModel, Stages, load_model

# A catch-up of up to this many tokens is attended as decode rows, not as a prefill: after a check the draft
# catches up on 2 tokens (the last guess and the target's own), which then share the step with the other
# sequences' decodes (the one-call CPU decode) instead of splitting it into a decode and a prefill part.
CATCH_UP_ROWS = 16


def check_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft's guesses are token ids of the target's vocabulary: refuse a draft whose ids mean other tokens."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    why = ""
    if tv != dv:
        why = f"its vocabulary has {dv} ids, the target's {tv}"
    else:
        t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        if t_vocab != d_vocab:
            t_ids = {i: t for t, i in t_vocab.items()}
            differ = sorted({i for t, i in d_vocab.items() if t_ids.get(i) != t} | (set(t_ids) - set(d_vocab.values())))
            i = differ[0]
            why = (f"their tokenizers differ in {len(differ)} token ids (id {i} is {t_ids.get(i)!r} for the target, "
                   f"{next((t for t, j in d_vocab.items() if j == i), None)!r} for the draft)")
    if why:
        raise ValueError(f"speculative_config: the draft model {draft.name} cannot draft for {target.name}: {why}. "
                         "A draft model must share the target's tokenizer (e.g. a smaller model of its family)")


@dataclass
class _Draft:
    """One target sequence's draft: its sequence in the draft pool, and what is known to match the target."""

    target: Sequence
    seq: Sequence
    spec: Any = None  # the target's SpecState when last synced: a new one means a new request (tokens may differ)
    synced: int = 0  # the target's length then: the draft's tokens up to it were the target's


class DraftModelProposer:
    """Guesses from a draft model with its own KV pool (see the module's docstring)."""

    def __init__(self, config: SpeculativeConfig, draft: LoadedModel, target: LoadedModel, num_blocks: int,
                 block_size: int, max_num_seqs: int, device: torch.device, backend: str) -> None:  # fmt: skip
        check_vocabulary(target, draft)
        self.k, self.loaded, self.max_model_len = config.num_speculative_tokens, draft, draft.max_model_len
        # As many tokens as the target's pool, plus room for every running sequence's guesses
        num_blocks += max_num_seqs * (cdiv(self.k, block_size) + 1)
        layout = KVLayout.of([a.window for a in draft.model.attention_layers()])  # its own groups, as the target's
        self.bm = BlockManager(num_blocks * layout.num_groups, block_size, False, layout.windows)
        kv_shape = (layout.slots, num_blocks * layout.num_groups, block_size, draft.num_kv_heads, draft.head_dim)
        self.runner = ModelRunner(draft.model, kv_shape, draft.dtype, device, backend, layout)
        self.drafts: OrderedDict[int, _Draft] = OrderedDict()  # target seq_id -> draft, least recently used first
        self.forwards = self.draft_tokens = 0  # the draft's work, for the bench

    def kind(self, seq: Sequence) -> int:
        """A draft always has guesses, all of one kind."""
        return 0

    def propose_batch(self, wanted: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to k greedy guesses per (target sequence, k): seq_id -> guesses. Sequences the draft pool has no
        room for (or past the draft's context) get none."""
        self._collect()
        busy = {seq.seq_id for seq, _ in wanted}
        active: list[tuple[_Draft, int]] = []
        for seq, k in wanted:
            k = min(k, self.max_model_len - len(seq))  # the last guess's position is never computed
            if k < 1:
                continue
            draft = self._sync(seq)
            if self._room(draft, len(draft.seq) - draft.seq.num_computed_tokens + k - 1, busy):
                active.append((draft, k))
        # short catch-ups first, attended as decode rows (a row per token, as the target's check); long ones (a
        # new prompt) as prefills
        active.sort(key=lambda dk: len(dk[0].seq) - dk[0].seq.num_computed_tokens > CATCH_UP_ROWS)
        guesses: dict[int, list[int]] = {d.target.seq_id: [] for d, _ in active}
        for j in range(max((k for _, k in active), default=0)):
            step = [d for d, k in active if k > j]
            counts = [len(d.seq) - d.seq.num_computed_tokens for d in step]
            batch = ScheduledBatch([d.seq for d in step], counts, sum(1 for n in counts if n <= CATCH_UP_ROWS))
            tokens = argmax(self.runner.run(batch)).tolist()
            for d, n, token in zip(step, counts, tokens):
                d.seq.num_computed_tokens += n
                d.seq.token_ids.append(token)
                guesses[d.target.seq_id].append(token)
            self.forwards, self.draft_tokens = self.forwards + 1, self.draft_tokens + sum(counts)
        return guesses

    def _sync(self, seq: Sequence) -> _Draft:
        """seq's draft with the target's tokens, its KV rolled back to the longest prefix they still share."""
        draft = self.drafts.get(seq.seq_id)
        if draft is None:
            draft = self.drafts[seq.seq_id] = _Draft(seq, Sequence([]))
            draft.seq.owner = seq.owner
        self.drafts.move_to_end(seq.seq_id)
        mine, theirs = draft.seq.token_ids, seq.token_ids
        start = draft.synced if draft.spec is seq.spec else 0  # within a request the target's tokens only grow
        # its last token is fed again even where the draft computed it (a guess the target kept but did not check:
        # its step's token budget or memory cut the guesses short): its logits are the first guess's
        common = min(draft.seq.num_computed_tokens, len(theirs) - 1)
        start = min(start, common)
        if mine[start:common] != theirs[start:common]:  # rejected guesses, or another request's tokens
            differ = np.flatnonzero(np.asarray(mine[start:common]) != np.asarray(theirs[start:common]))
            common = start + int(differ[0])
        self.bm.rollback(draft.seq, common)
        del mine[common:]
        mine += theirs[common:]
        draft.spec, draft.synced = seq.spec, len(theirs)
        return draft

    def _room(self, draft: _Draft, num_tokens: int, busy: set[int]) -> bool:
        """Slots for num_tokens more of draft's tokens, taken from the drafts of idle sequences (least recently
        used first) if need be; False (nothing taken) where even that is not enough."""
        while not self.bm.can_append(draft.seq, num_tokens):
            idle = next((sid for sid, d in self.drafts.items() if sid not in busy and d.seq.block_table), None)
            if idle is None:
                return False
            self._free(idle)
        self.bm.append_slots(draft.seq, num_tokens)
        return True

    def _collect(self) -> None:
        """A draft keeps its KV while its target keeps its own: free those of finished, preempted and reclaimed
        sequences (a parked conversation's stays, for its next turn)."""
        for sid, draft in list(self.drafts.items()):
            if draft.target.status is SequenceStatus.FINISHED or not draft.target.block_table:
                self._free(sid)

    def _free(self, seq_id: int) -> None:
        self.bm.free(self.drafts.pop(seq_id).seq)


def make_proposer(config: SpeculativeConfig | None, target: LoadedModel, num_blocks: int, block_size: int,
                  max_num_seqs: int, device: torch.device, backend: str, weight_cache: bool = True,
                  stages: Stages | None = None) -> Proposer | None:  # fmt: skip
    """The proposer a speculative config asks for (None: no speculation); a draft model is loaded here."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    (stages or Stages())(f"loading the draft model {config.model}")
    draft = load_model(config.model, dtype=target.dtype, device=device, quantization=config.quantization,
                       weight_cache=weight_cache)
    return DraftModelProposer(config, draft, target, num_blocks, block_size, max_num_seqs, device, backend)


__all__ = ["DraftModelProposer", "check_vocabulary", "make_proposer"]
