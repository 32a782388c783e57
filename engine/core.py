"""EngineCore: requests in, outputs out, one step (schedule, run, sample, update) at a time."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from engine.block_manager import BlockManager, cdiv
from engine.config import EngineConfig
from engine.draft import make_proposer
from engine.events import CacheSnapshot, EngineInfo, StepStats
from engine.kv_groups import KVLayout
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor, RequestOutput
from engine.requests import ContextLengthError, RequestError, validate
from engine.sampler import Sampler, SamplingTensors, argmax, make_generator, prompt_logprobs, token_logprobs
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from engine.spec_decode import SpecTrace, SpeculativeConfig, generator_states, rewind
from engine.structured import GrammarError, StructuredOutputs
from engine.weights.loader import LoadedModel, Stages
from kernels.cpu import ops as cpu_ops

log = logging.getLogger(__name__)


def _penalised(seq: Sequence, end: int) -> list[int]:
    """The tokens before `end` a repetition penalty looks at (see SamplingParams.repetition_window)."""
    window = seq.group.params.repetition_window
    if window is None and end == len(seq):
        return seq.token_ids  # the whole context, uncopied (a plain step's row)
    return seq.token_ids[max(seq.num_prompt_tokens, end - window) if window is not None else 0 : end]


def _row_ends(seqs: list[Sequence]) -> list[int]:
    """The tokens each sampled row follows: a sequence's length, or for the rows of a speculative sequence
    (consecutive) its last token's and each guess's position."""
    ends, j = [], 0
    for i, seq in enumerate(seqs):
        j = j + 1 if i and seqs[i - 1] is seq else 0
        ends.append(len(seq) - seq.num_draft_tokens + j)
    return ends


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, stages: Stages | None = None) -> None:
        say = stages or Stages()
        self.loaded, self.config, self.tokenizer = loaded, config, loaded.tokenizer
        # The KV cache holds what the model computes: the loaded model's dtype, whatever the config said
        device, dtype = torch.device(config.device), loaded.dtype
        if dtype != config.torch_dtype:
            log.info("KV cache in %s, the loaded model's dtype (the config said %s)", dtype, config.dtype)
            config.dtype = str(dtype).removeprefix("torch.")
        if loaded.dtype_reason:  # the loader's word (a measured bfloat16) over the config's guess
            config.reason = f"{loaded.dtype_reason}; {config.kernels}"
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        # sliding-window layers get a KV cache group of their own (engine/kv_groups.py); a block holds one per page
        self.kv_layout = layout = KVLayout.of([a.window for a in loaded.model.attention_layers()])
        slots, bs, kv_heads, head_dim = layout.slots, config.block_size, loaded.num_kv_heads, loaded.head_dim
        self.kv_block_bytes = 2 * slots * bs * kv_heads * head_dim * dtype.itemsize  # K and V, a page's layers
        num_blocks = config.resolve_num_blocks(self.kv_block_bytes)
        say(f"allocating the KV pool ({num_blocks} blocks of {config.block_size} tokens)")
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, layout.windows)
        self.max_model_len = min(loaded.max_model_len, self.block_manager.num_usable_blocks // layout.num_groups * bs)
        proposer = make_proposer(SpeculativeConfig.parse(config.speculative_config), loaded, num_blocks, bs,
                                 config.max_num_seqs, device, config.attention_backend, config.weight_cache, say)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   proposer, self.max_model_len)
        kv_shape = (slots, num_blocks, bs, kv_heads, head_dim)
        self.runner = ModelRunner(loaded.model, kv_shape, dtype, device, config.attention_backend, layout)
        if config.cuda_graphs:
            self.runner.capture_decode_graphs(config.max_num_seqs, cdiv(self.max_model_len, bs))
        self.sampler = Sampler()
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, loaded.config.vocab_size, sorted(self.eos_token_ids))
        self.groups: dict[str, SequenceGroup] = {}
        self.on_step: Callable[[StepStats], None] | None = None  # per-step stats hook (the bench)
        self._ids = itertools.count()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) for tokens/s
        self._ended: list[RequestOutput] = []  # final outputs taken before a step, sent with the next
        self._streams: dict[int, torch.Tensor] = {}  # speculative sequences' seeded streams before sampling
        # Unseeded requests draw from torch's global RNG, whose start-up seed is a constant:
        # reseed it from the OS so the same first message gets a different reply each launch.
        if config.seed is None:
            torch.seed()
        else:
            torch.manual_seed(config.seed)

    @property
    def info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            name=self.loaded.name, is_demo=self.loaded.is_demo, device=c.device,
            dtype=c.dtype, backend=c.attention_backend, reason=c.reason, quantization=c.quantization,
            kernels=cpu_ops.build_status() if self.runner.device.type == "cpu" else self.runner.device.type,
            num_blocks=self.block_manager.num_blocks, block_size=c.block_size, max_model_len=self.max_model_len,
            generation_defaults=dict(self.loaded.generation_defaults), generation_source=self.loaded.generation_source,
            kv_block_bytes=self.kv_block_bytes, notice=self.loaded.notice,
        )  # fmt: skip

    @property
    def prefill_tokens(self) -> int:
        """Tokens computed by prefill over the engine's life (a bench figure)."""
        return self.scheduler.prefill_tokens

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        validate(token_ids, params, self.max_model_len, self.loaded.config.vocab_size, self.config.max_num_seqs,
                 self.block_manager.num_usable_blocks // self.kv_layout.num_groups, self.config.block_size)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        *, conversation_id: str | None = None, seq: Sequence | None = None, cache_salt: str | None = None,
    ) -> str:  # fmt: skip
        """Queue a request; `seq` (a conversation's parked sequence) is reused with its blocks. `cache_salt`:
        the prompt's KV is shared only with requests of the same salt (a new sequence's; `seq` has its own)."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = seq or Sequence(self.encode(prompt), cache_salt=cache_salt)
        self._validate(seq.token_ids, params)
        try:  # a cache hit where the caller compiled it already, off the engine thread
            grammar = self.structured.compile(params.structured) if params.structured else None
        except GrammarError as e:
            raise RequestError(str(e)) from None
        group = SequenceGroup(request_id, [seq], params, conversation_id=conversation_id, prompt_len=len(seq),
                              grammar=grammar)
        if params.prompt_logprobs is not None:  # every prompt position computed here: a chain no other hits
            self.block_manager.free(seq)  # a parked sequence's KV too: its positions need their logits
            seq.cache_salt, seq.block_hashes, group.prompt_logprobs = os.urandom(16).hex(), [], [None]
        seq.group, seq.index, seq.owner = group, 0, conversation_id or request_id
        seq.num_prompt_tokens, seq.finish_reason, seq.finish_time, seq.generator = len(seq), None, None, None
        seq.detokenizer, seq.pending_text = None, ""  # a parked sequence's last turn is done with
        seq.logprobs, seq.logprobs_sent, seq.matcher, seq.spec = [], 0, None, None
        self.groups[request_id] = group
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is not None:
            try:
                for seq in group.seqs:
                    if seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
                        self._finish(seq, "abort")
            except Exception as e:  # e.g. its detokenizer's flush: end the request with the error
                self._fail(group, f"{type(e).__name__}: {e}")

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups or self._ended)

    # Hooks of the layer on top (conversations)
    def _parks(self, group: SequenceGroup) -> bool:  # does a finished sequence keep its blocks?
        return False

    def _finished(self, seq: Sequence, text: str, cut_by_stop_string: bool) -> None: ...

    def _failed(self, group: SequenceGroup) -> None: ...  # its sequences are released already

    def _ended_group(self, group: SequenceGroup) -> None: ...  # its final output was taken

    def step(self) -> list[RequestOutput]:
        timed = self.on_step is not None
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return self._collect([])
        groups = list({s.group.request_id: s.group for s in batch.seqs}.values())
        t1 = time.perf_counter()
        stats = self._stats(batch, t1 - t0) if timed else None
        try:
            scoring = self.scheduler.logit_rows(batch)
            if scoring is None:
                logits = self.runner.run(batch, sync=timed)  # copy-on-write copies first, then the forward
            else:  # the logits of the prompt positions due for logprobs too, then of the rows that sample
                rows, spans = scoring
                logits = self.runner.run(batch, rows=rows, sync=timed)
                for group, next_tokens, first in spans:
                    group.prompt_logprobs += prompt_logprobs(logits[first : first + len(next_tokens)], next_tokens,
                                                             group.params.prompt_logprobs)
                logits = logits[sum(len(t) for _, t, _ in spans):]
            t2 = time.perf_counter()
            rows, seqs = self.scheduler.advance(batch)
            if len(rows) != len(logits):  # n > 1 groups forked: their rows repeat
                logits = logits[rows]
            tokens = self._sample(logits, seqs) if seqs else []
        except Exception as e:  # the batch is lost, the engine is not: its requests end with the error
            for group in groups:  # (releasing a sequence drops its unchecked guesses)
                self._fail(group, f"{type(e).__name__}: {e}")
            return self._collect([])
        t3 = time.perf_counter()
        if self.scheduler.proposer is not None and batch.num_decodes == len(batch.seqs):  # what guesses cost
            self.scheduler.step_cost.record(sum(batch.num_tokens), t3 - t1)
        self._update(seqs, tokens)
        if stats is not None:
            stats.prepare_s = self.runner.last_prepare_s
            stats.model_s, stats.sample_s = t2 - t1 - stats.prepare_s, t3 - t2
            self.on_step(stats)
        return self._collect(groups)

    def _stats(self, batch: ScheduledBatch, schedule_s: float) -> StepStats:
        bm = self.block_manager
        return StepStats(
            len(batch.seqs), batch.num_decodes, sum(batch.num_tokens),
            sum(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_tokens)),
            bm.num_blocks - bm.num_free_blocks, sum(len(s.block_table) for s in bm.holders.values()),
            schedule_s, 0.0, 0.0, 0.0,
        )  # fmt: skip

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        self.structured.mask(logits, seqs)  # constrained rows only; in place
        params = [s.group.params for s in seqs]
        penalised = any(p.repetition_penalty != 1.0 for p in params)
        seen = [_penalised(s, e) for s, e in zip(seqs, _row_ends(seqs))] if penalised else None
        if all(p.greedy for p in params) and not penalised:
            tokens = argmax(logits)  # all greedy, the bench's case: no parameter tensors to build
        else:
            for s, p in zip(seqs, params):  # a seeded sample's own stream, from its first token on
                if s.generator is None and not p.greedy and p.seed is not None:
                    s.generator = make_generator(p.seed, s.index, self.runner.device)
            self._streams = generator_states(seqs)  # rewound once the guesses are checked
            st = SamplingTensors.build(params, [s.generator for s in seqs], logits.device)
            tokens = self.sampler(logits, st, seen)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if rows:  # only the rows that asked: the others pay nothing
            for i, lp in zip(rows, token_logprobs(logits, rows, tokens, params, seen)):
                seqs[i].logprobs.append(lp)
        return tokens.tolist()

    def _update(self, seqs: list[Sequence], tokens: list[int]) -> None:
        starts = [i for i in range(len(seqs)) if not i or seqs[i] is not seqs[i - 1]]  # a speculative one's rows
        appended = 0
        for i, end in zip(starts, starts[1:] + [len(seqs)]):
            seq, state = seqs[i], self._streams.pop(seqs[i].seq_id, None)
            if seq.group.error is not None:  # failed this step (e.g. a sibling sample): its tokens are dropped
                continue
            emitted = self.scheduler.accept(seq, tokens[i:end]) if end - i > 1 else [tokens[i]]
            if state is not None:
                rewind(seq.generator, state, len(emitted))
            for token in emitted:
                appended += 1
                if not self._append(seq, token):
                    break
        self._recent.append((time.monotonic(), appended))

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append one token to seq; False once it is finished (or failed)."""
        reason = self.scheduler.append_token(seq, token, self.eos_token_ids, self.max_model_len)
        try:
            if self.structured.accept(seq, token) and reason is None:
                reason = "stop"  # its grammar is complete
            if reason != "stop" and self.outputs.append(seq, token):
                reason = "stop"  # a stop string beats the length limit
            if reason is not None:
                self._finish(seq, reason)
        except Exception as e:  # one request's failure (e.g. its detokenizer) ends only that request
            self._fail(seq.group, f"{type(e).__name__}: {e}")
            return False
        return reason is None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finish_reason is not None:
            return
        self.scheduler.finish(seq, reason, park=self._parks(seq.group))
        self._finished(seq, *self.outputs.finish(seq, reason))

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request in flight with an error (after an unexpected engine failure)."""
        for group in list(self.groups.values()):
            self._fail(group, message)
        return self._collect([])

    def recover(self, message: str) -> list[RequestOutput]:
        """After an engine failure: end every request with an error; if even that fails, forget
        them (they get no final output) so the engine can serve new requests."""
        try:
            return self.fail_all(message)
        except Exception:
            for group in self.groups.values():
                for seq in group.seqs:
                    with contextlib.suppress(Exception):  # best effort: give back what can be given back
                        self.scheduler.release(seq)
            self.groups.clear()
            self._ended.clear()
            raise

    def _fail(self, group: SequenceGroup, message: str) -> None:
        """End one request with an error; its sequences' blocks go back."""
        group.error = message
        for seq in group.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
            self.scheduler.release(seq)
        self._failed(group)

    def _collect(self, touched: list[SequenceGroup]) -> list[RequestOutput]:
        outputs, self._ended = self._ended, []
        for group in touched:
            outputs.append(self._end(group) if self._group_done(group) else self.outputs.output(group, False))
        # Aborted groups that were not scheduled this step still need their final output.
        return outputs + [self._end(group) for group in list(self.groups.values()) if self._group_done(group)]

    def _end(self, group: SequenceGroup) -> RequestOutput:
        """The finished group's final output; it leaves the engine."""
        del self.groups[group.request_id]
        self._ended_group(group)
        return self.outputs.output(group, True)

    @staticmethod
    def _group_done(group: SequenceGroup) -> bool:
        if group.error is not None:
            return True
        # An aborted group may never have forked its n-1 siblings.
        forked = len(group.seqs) == group.params.n or group.seqs[0].finish_reason in ("abort", "error")
        return forked and all(s.finish_reason for s in group.seqs)

    def generate(
        self, prompts: Seq[str] | Seq[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def preempted_requests(self) -> set[str]:
        """Requests with a sample sent back to wait for KV memory after it had begun (preempted)."""
        return {s.group.request_id for s in self.scheduler.waiting if s.num_output_tokens and s.group is not None}

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] at every position of token_ids from one prefill through the engine's own
        paged path (fresh blocks, freed after), to compare with other implementations. Only on an idle engine."""
        if self.has_unfinished_requests():
            raise RequestError("score() needs an idle engine")
        if not 0 < len(token_ids) <= self.max_model_len:
            raise ContextLengthError(f"score() takes 1 to {self.max_model_len} tokens; got {len(token_ids)}")
        if max(token_ids) >= self.loaded.config.vocab_size or min(token_ids) < 0:
            raise RequestError(f"token ids must be in [0, {self.loaded.config.vocab_size})")
        seq = Sequence(token_ids)
        if not self.block_manager.can_append(seq, len(seq)):  # parked chats may hold the pool
            raise RequestError(f"scoring {len(seq)} tokens needs {cdiv(len(seq), self.config.block_size)} free KV "
                               f"blocks; {self.block_manager.num_free_blocks} are free")
        try:
            self.block_manager.append_slots(seq, len(seq))
            return self.runner.run(ScheduledBatch([seq], [len(seq)], 0), all_logits=True)
        finally:
            self.block_manager.free(seq)

    def spec_cost(self) -> str:
        """What speculation's measured-cost rule stands on (StepCost.describe)."""
        return self.scheduler.step_cost.describe()

    def tokens_per_s(self, window: float = 2.0) -> float:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > window:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / max(now - self._recent[0][0], 1e-3) if self._recent else 0.0

    def cache_snapshot(self) -> CacheSnapshot:
        bm, sched = self.block_manager, self.scheduler
        state, refcount, owners = bm.block_states()
        # speculation's marks since the last snapshot; recorded from the first one on (nobody looking: no cost)
        trace, sched.spec_trace = sched.spec_trace, SpecTrace() if sched.proposer is not None else None
        return CacheSnapshot(
            num_blocks=bm.num_blocks, block_size=bm.block_size, state=tuple(state), refcount=tuple(refcount),
            owners=tuple(owners), num_running=len(sched.running), num_waiting=len(sched.waiting),
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits, cow_copies=bm.cow_copies,
            preemptions=sched.preemptions, tokens_per_s=self.tokens_per_s(), time=time.monotonic(),
            constrained=tuple(sorted({s.owner for g in self.groups.values() if g.grammar is not None for s in g.seqs})),
            spec_drafts=sched.spec_steps, spec_draft_tokens=sched.spec_draft_tokens,
            spec_accepted_tokens=sched.spec_accepted_tokens, spec_accepted_per_pos=tuple(sched.spec_accepted_per_pos),
            **(trace.marks(state) if trace is not None else {}),
            **(dict(group=tuple(bm.block_groups()), group_names=self.kv_layout.names())
               if self.kv_layout.num_groups > 1 else {}),
        )  # fmt: skip
