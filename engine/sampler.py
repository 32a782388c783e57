"""Next tokens from one step's logits, vectorised over the batch with per-row parameters. Order as in HF
`generate` and vLLM: repetition penalty, greedy argmax, temperature, top-k, top-p, min-p, then the draw:
one uniform u per row (from the row's own generator when seeded) picks the token where the kept tokens'
running weight, in vocabulary order, passes u times their total.

On the CPU one C++ call does it all (kernels/cpu/sample.cpp: sample_rows, no sort of the vocabulary, no
random number per token), so any setting costs about what greedy does; elsewhere (CUDA, no kernels) the
same stages run as torch ops, a stage only when some row needs it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.events import TokenLogprob
from engine.sequence import SamplingParams
from kernels.cpu import ops as cpu_ops

_MASK64 = (1 << 64) - 1
LOGPROB_FLOOR = -9999.0  # the lowest logprob reported (for -inf: a token that could not be chosen)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_generator(seed: int | None, index: int, device: torch.device | str) -> torch.Generator | None:
    """Sample `index`'s random stream (None when unseeded): hashing (seed, index) keeps n samples distinct."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ index))


@dataclass
class SamplingTensors:
    """One step's per-row sampling parameters as [B] tensors, plus flags to skip unused stages."""

    temperatures: Tensor  # [B] float32; 1.0 on greedy rows (they take the argmax instead)
    kernel_temperatures: Tensor  # [B] float32; 0.0 on greedy rows (sample_rows' greedy mark)
    top_ks: Tensor  # [B] int64; 0 = off
    top_ps: Tensor  # [B] float32; 1.0 = off
    min_ps: Tensor  # [B] float32; 0.0 = off
    repetition_penalties: Tensor  # [B] float32; 1.0 = off
    greedy: Tensor  # [B] bool
    generators: list[torch.Generator | None]  # per row; None draws from the default generator
    all_greedy: bool
    any_greedy: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    do_penalties: bool
    any_unseeded: bool  # some sampled row has no generator

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              device: torch.device | str) -> SamplingTensors:  # fmt: skip
        greedy = [p.greedy for p in params]
        # Greedy rows get neutral values so they never switch a filtering stage on.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        penalties = [p.repetition_penalty for p in params]  # applies to greedy rows too (as in HF)
        # One host->device copy for all float parameters.
        kernel_temps = [0.0 if g else t for t, g in zip(temps, greedy)]
        floats = torch.tensor([temps, top_ps, min_ps, penalties, kernel_temps], dtype=torch.float32).to(device)
        return cls(
            temperatures=floats[0], kernel_temperatures=floats[4],
            top_ks=torch.tensor(top_ks, dtype=torch.int64).to(device), top_ps=floats[1],
            min_ps=floats[2], repetition_penalties=floats[3], greedy=torch.tensor(greedy, dtype=torch.bool).to(device),
            generators=[None if g else gen for g, gen in zip(greedy, generators)],
            all_greedy=all(greedy), any_greedy=any(greedy), do_top_k=any(k > 0 for k in top_ks),
            do_top_p=any(p < 1.0 for p in top_ps), do_min_p=any(p > 0.0 for p in min_ps),
            do_penalties=any(p != 1.0 for p in penalties),
            any_unseeded=any(not g and gen is None for g, gen in zip(greedy, generators)),
        )  # fmt: skip


def apply_repetition_penalty(logits: Tensor, seen_token_ids: list[list[int]], penalties: Tensor) -> Tensor:
    """HF semantics: a seen token's logit is divided by p if positive, multiplied by p otherwise. Rows are
    padded with their own first token (padding rewrites the same value); rows with nothing seen get p = 1."""
    width = max((len(ids) for ids in seen_token_ids), default=0)
    if width == 0:
        return logits
    padded = [ids + [ids[0]] * (width - len(ids)) if ids else [0] * width for ids in seen_token_ids]
    index = torch.tensor(padded, dtype=torch.int64).to(logits.device)
    empty = torch.tensor([not ids for ids in seen_token_ids]).to(logits.device)
    p = torch.where(empty, torch.ones_like(penalties), penalties)[:, None]
    seen = logits.gather(1, index)
    seen = torch.where(seen > 0, seen / p, seen * p)
    return logits.scatter(1, index, seen)


def apply_top_k_top_p(logits: Tensor, top_ks: Tensor | None, top_ps: Tensor | None) -> Tensor:
    """Mask (to -inf) tokens outside each row's top-k (0 = off) and nucleus (1 = off; None skips either stage):
    the smallest set of top tokens whose probability reaches p, never empty. One descending sort serves both."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_ks is not None:
        k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    if top_ps is not None:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
        drop = (before >= top_ps[:, None]) & (top_ps < 1.0)[:, None]  # p = 1 rows: no float drift
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def argmax(logits: Tensor, chunk: int = 256) -> Tensor:
    """Row-wise argmax (first index of the maximum, as torch.argmax). On CPU our kernel where it is built,
    else per-chunk amax, then within the best chunk: torch's CPU argmax is not vectorised and costs ~9x
    more on a [64, 49152] batch."""
    if logits.dim() == 2 and logits.shape[-1] and cpu_ops.use_fused(logits):
        return cpu_ops.argmax_rows(logits.contiguous())
    if logits.device.type != "cpu" or logits.shape[-1] < 4 * chunk:
        return logits.argmax(dim=-1)
    rows, vocab = logits.shape
    pad = -vocab % chunk
    x = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    x = x.view(rows, -1, chunk)
    best_chunk = x.amax(dim=-1).argmax(dim=-1)
    within = x[torch.arange(rows), best_chunk].argmax(dim=-1)
    return best_chunk * chunk + within


def uniforms(st: SamplingTensors) -> Tensor:
    """One draw in [0, 1) per row, float64: seeded rows from their own generator, so their tokens do not
    depend on the rest of the batch; greedy rows get one too (unused) to keep the others' streams apart."""
    u = torch.empty(len(st.generators), dtype=torch.float64, device=st.temperatures.device)
    if st.any_unseeded or st.all_greedy:
        u.uniform_()
    for row, gen in enumerate(st.generators):
        if gen is not None:
            u[row : row + 1].uniform_(generator=gen)
    return u


def flat_seen(seen_token_ids: list[list[int]] | None, rows: int) -> tuple[Tensor, Tensor]:
    """Each row's seen ids, concatenated, and the rows' offsets into them ([rows + 1])."""
    if seen_token_ids is None:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(rows + 1, dtype=torch.int64)
    # chained in C, not a Python loop over every token of every context each step
    offsets = list(itertools.accumulate((len(ids) for ids in seen_token_ids), initial=0))
    flat = list(itertools.chain.from_iterable(seen_token_ids))
    return torch.tensor(flat, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


class Sampler:
    def __call__(self, logits: Tensor, st: SamplingTensors, seen_token_ids: list[list[int]] | None = None) -> Tensor:
        """Next token per row: [B] int64. seen_token_ids (prompt + output, per row) is needed only
        when some row has a repetition penalty. Logits are left as they are."""
        if st.do_penalties and seen_token_ids is None:
            raise ValueError("repetition_penalty needs seen_token_ids")
        if st.all_greedy and not st.do_penalties:
            return argmax(logits)
        if logits.dim() == 2 and logits.shape[-1] and cpu_ops.use_fused(logits):
            seen, offsets = flat_seen(seen_token_ids if st.do_penalties else None, logits.shape[0])
            return cpu_ops.sample_rows(logits.contiguous(), seen, offsets, st.repetition_penalties,
                                       st.kernel_temperatures, st.top_ks, st.top_ps, st.min_ps, uniforms(st))
        return self._sample_torch(logits, st, seen_token_ids)

    @staticmethod
    def _sample_torch(logits: Tensor, st: SamplingTensors, seen_token_ids: list[list[int]] | None) -> Tensor:
        if st.do_penalties:
            logits = apply_repetition_penalty(logits.float(), seen_token_ids or [], st.repetition_penalties)
        if st.all_greedy:
            return argmax(logits)
        greedy_tokens = argmax(logits) if st.any_greedy else None

        logits = logits.float() / st.temperatures[:, None]  # out of place: caller's logits stay intact
        if st.do_top_k or st.do_top_p:
            logits = apply_top_k_top_p(logits, st.top_ks if st.do_top_k else None, st.top_ps if st.do_top_p else None)
        probs = logits.softmax(dim=-1)
        if st.do_min_p:  # zero tokens below min_p times the row's top probability (the draw needs no normalising)
            probs = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * st.min_ps[:, None], 0.0)
        tokens = Sampler._draw_torch(probs, uniforms(st))
        if greedy_tokens is not None:
            tokens = torch.where(st.greedy, greedy_tokens, tokens)
        return tokens

    @staticmethod
    def _draw_torch(probs: Tensor, u: Tensor) -> Tensor:
        """The token where the running weight (vocabulary order) first passes u times the total (unnormalised
        is fine; tokens of weight 0 are never picked)."""
        cum = probs.double().cumsum(dim=-1)
        target = (u * cum[:, -1])[:, None]
        return torch.searchsorted(cum, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _logprob_entries(x: Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row j of x [n, vocab] as a distribution: token_ids[j]'s log-probability and the ks[j] most likely. A token
    that cannot be chosen (a grammar masks it: -inf, which JSON cannot carry) is floored as vLLM does."""
    lp = torch.log_softmax(x.float(), dim=-1).clamp_(min=LOGPROB_FLOOR)
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])[:, 0].tolist()
    k = max(ks, default=0)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return [TokenLogprob(t, c, tuple(zip(i[:kj], v[:kj])))
            for t, c, i, v, kj in zip(token_ids, chosen, top_i.tolist(), top_v.tolist(), ks)]


def prompt_logprobs(logits: Tensor, next_tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each prompt position's logits [n, vocab] scoring the token that follows it (vLLM's prompt logprobs:
    the model's raw distribution), with the k most likely tokens there."""
    return _logprob_entries(logits, next_tokens, [k] * len(next_tokens))


def token_logprobs(logits: Tensor, rows: list[int], tokens: Tensor, params: list[SamplingParams],
                   seen_token_ids: list[list[int]] | None) -> list[TokenLogprob]:
    """For the rows that asked: the sampled token's log-probability under the distribution sampled from
    (vLLM's "processed" logprobs: after the repetition penalty and the temperature; before top-k/top-p/min-p,
    which only cut its tail), and the row's k most likely tokens. Greedy rows: temperature 1."""
    index = torch.tensor(rows, device=logits.device)
    x = logits.index_select(0, index).float()
    ps = [params[i] for i in rows]
    if seen_token_ids is not None and any(p.repetition_penalty != 1.0 for p in ps):
        penalties = torch.tensor([p.repetition_penalty for p in ps], device=x.device)
        x = apply_repetition_penalty(x, [seen_token_ids[i] for i in rows], penalties)
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in ps], device=x.device)
    return _logprob_entries(x / temps[:, None], tokens.index_select(0, index).tolist(), [p.logprobs for p in ps])
