"""Speculative decoding with the model's MTP layer: EAGLE-style chains of N draft tokens.

`Engine(runner, tokenizer, speculative_num_steps=N)` (N >= 1) runs every step through
`MtpSpeculator.step` instead of the plain loop. The runner must `supports_speculative` (the torch
target, on one rank or several through `distributed.DistRunner`; the CUDA target not yet) and the
engine does not overlap steps in this mode: acceptance decides the next step's inputs, so each
step's tokens are read before the next is scheduled.

The MTP layer at position i reads the target's final hidden state at i and the token at i + 1 and
guesses the token at i + 2; its KV lives in its own pool layer at the slot of position i. One step,
for a request whose first n tokens have KV, token n pending and drafts d_1..d_D from the last step:

1. verify: one target forward over [t_n, d_1, .., d_D] at positions n..n+D (the `mtp_verify`
   phase: logits and hidden states at every position; prefill chunks of other requests share it);
2. accept: keep a prefix of the drafts (a of them: below) and append them and one token of the
   target's at position n+a (the first rejected draft's replacement, or the bonus token); the
   target's KV of positions n+a+1.. is rejected: the scheduler rolls back to n+a+1 computed tokens
   (pages past the next token's freed, slots in the last page overwritten later; only pages full of
   accepted tokens reach the prefix cache);
3. draft-extend: the MTP layer over the positions the target just computed and kept (n..n+a, or a
   prefill chunk's), fed the target's hidden states there and the tokens one further: this writes
   the MTP layer's KV (its own indexer keys included) and its last position guesses d'_1;
4. draft: D' - 1 more MTP steps, one token each, fed the MTP layer's own hidden state (the input of
   the shared head, as SGLang's EAGLE worker does); positions n+a+1.. get MTP KV that the next
   draft-extend overwrites. D' = min(N, tokens the request may still generate); their pages are
   reserved now, and a request whose pages do not fit drafts nothing (it decodes plainly).

Greedy requests (temperature 0) draft the MTP layer's argmax and keep the longest prefix of
drafts equal to the target's own argmax: output equals the plain engine's token for token. Every
appended token is read at its position with the context, history (penalties) and RNG counter it
has there when every draft before it holds (`as_if_accepted`: counter + j at position n+j).

Sampled requests (temperature > 0) use standard speculative sampling (`spec_sampling.py`): drafts
are drawn from q, the MTP layer's distribution after the plain sampler's own processing for that
request (bias, penalties, temperature, top-k, top-p, min-p), and q is kept per draft; at verify
position j, p is the plain sampler's distribution there (`sampling.probabilities`), d_{j+1} is
accepted with probability min(1, p/q), the first rejection emits a draw from
normalize(max(0, p - q)), and when all drafts hold the bonus token is the plain sampler's draw.
The output distribution is the plain sampler's exactly (the tokens themselves differ from a plain
run with the same seed, and depend on the drafts: on N and on the MTP layer's KV); each random
choice is a counter-based hash of (seed, counter, stream), so a seeded request gives the same
output on a re-run whatever shares its batch. Logprobs are the target's raw ones for the token
emitted. Acceptance per draft is sum_x min(p(x), q(x)), against p(argmax q) for drafts that are the
argmax (what exact matching of argmax drafts to the plain sampler's draws, the rule before, got).
Drafts without q rows (none kept) are verified by that exact matching, which is exact for drafts
chosen any way; tests/test_spec_sampling.py measures the old rule's acceptance so.

Requests with a grammar (structured outputs) speculate too: every verified position is sampled
with the grammar's mask after the drafts before it (`grammar.token_bitmask` reads the request as
`as_if_accepted` leaves it), so the greedy argmax and p never give a token outside the grammar, a
draft the grammar forbids is rejected there, and drafts themselves are drawn inside it
(`spec_sampling.draw_drafts`). The grammar's state advances only as tokens are appended.

Approximations that only cost acceptance, never correctness: a prefix-cache hit reuses the MTP
KV of its pages as computed by the request that filled them (the last position of a page was fed
that request's next token; a request that finished skips its last draft-extend, so its last
step's positions keep the chain's MTP KV); draft steps k >= 1 see MTP KV of drafts, as in every
EAGLE chain.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.sampling import SamplingBatch, TokenLogprobs, sample_batch
from glmc.runtime.engine.spec_sampling import draw_drafts, verify_drafts, with_logprob
from glmc.runtime.engine.scheduler import ScheduledBatch, Scheduler
from glmc.runtime.worker.forward_batch import ForwardBatch


class EngineView(Protocol):
    """What the speculative step uses of the engine that owns it (`engine.Engine`, which imports
    this module: the engine is seen through this contract, not imported)."""
    scheduler: Scheduler
    runner: Any       # the engine's runner: verify_dp, draft_dp, kernels
    metrics: Any      # the engine's metrics: step, verify

    def append_token(self, req: Request, token: int, lp: TokenLogprobs | None) -> None:
        """Detokenize, stream and check stops for one accepted token, as a plain step does."""

    def update_gauges(self) -> None:
        """Refresh the engine's gauges after a step."""


def as_if_accepted(req: Request, draft: list[int]) -> Request:
    """`req` as the sampler sees it after `draft` was appended: its history (penalties) and RNG
    counter one further per draft token (a copy; `req` is not changed)."""
    return dataclasses.replace(req, output_ids=req.output_ids + draft) if draft else req


@dataclass
class _Verify:
    """One DP rank's verify step: its batch, each request's drafts and whether its next token is
    due (a prefill chunk short of the prompt's end is not)."""
    s: Scheduler
    batch: ScheduledBatch
    drafts: list[list[int]]
    q: list[list[torch.Tensor]]   # per sampled request with drafts: each draft's q row
    own: list[int]   # tokens per request known for sure: the batch's minus the drafts
    ready: list[bool]
    fb: ForwardBatch


@dataclass
class _Extend:
    """One DP rank's draft-extend: its unfinished requests, their batch and target hidden states."""
    s: Scheduler
    reqs: list[Request]
    fb: ForwardBatch
    hidden: torch.Tensor


class MtpSpeculator:
    """The engine's step in speculative mode (module docstring); owns no state of its own but the
    q rows of sampled requests' drafts (`draft_q`): drafts ride on `Request.draft_ids`, pages and
    rows on the engine's schedulers (one per attention-DP rank: every rank steps every forward,
    idle ones with an empty batch), and tokens reach clients through the engine's `append_token`
    (detokenize, stream, stop), as in plain steps."""

    def __init__(self, engine: EngineView, num_steps: int):
        self.engine, self.num_steps = engine, num_steps
        self.draft_q: dict[Request, list[torch.Tensor]] = {}

    def step(self) -> bool:
        """Schedule, verify + accept, draft; False when there was nothing to do."""
        e = self.engine
        batches = e.scheduler.schedule()
        if batches is not None:
            e.metrics.step([b for b in batches if b is not None])
            work = [self._prepare(s, b) if b is not None and b.reqs else None
                    for s, b in zip(e.scheduler.ranks, batches)]
            if any(work):
                self._run(work)
        # drafts a release dropped (retraction, abort) take their q rows with them
        self.draft_q = {r: q for r, q in self.draft_q.items() if r.draft_ids}
        e.update_gauges()
        return batches is not None

    def _idle(self) -> list[ForwardBatch]:
        return [ForwardBatch.idle(s.req_pool.table) for s in self.engine.scheduler.ranks]

    def _prepare(self, s: Scheduler, batch: ScheduledBatch) -> _Verify:
        reqs = batch.reqs
        drafts = [r.draft_ids[:max(n - r.num_pending, 0)] for r, n in zip(reqs, batch.extend_lens)]
        q = [self.draft_q.pop(r, [])[:len(d)] for r, d in zip(reqs, drafts)]
        q = [rows if len(rows) == len(d) else [] for rows, d in zip(q, drafts)]   # none kept: matching
        own = [n - len(d) for n, d in zip(batch.extend_lens, drafts)]
        ready = [p + n == r.num_tokens for r, p, n in zip(reqs, batch.prefix_lens, own)]
        for r in reqs:
            r.draft_ids = []
        fb = ForwardBatch.build(batch.mode, [r.all_ids[p:p + n] + d for r, p, n, d in
                                             zip(reqs, batch.prefix_lens, own, drafts)],
                                [r.row for r in reqs], batch.prefix_lens, s.req_pool.table)
        return _Verify(s, batch, drafts, q, own, ready, fb)

    def _run(self, work: list[_Verify | None]) -> None:
        fbs = [w.fb if w else idle for w, idle in zip(work, self._idle())]
        extends = []
        for w, (logits, hidden) in zip(work, self.engine.runner.verify_dp(fbs)):
            if w is None:
                extends.append(None)
                continue
            w.s.commit(w.batch)
            tokens = self._sample(logits, w)
            kept = [self._accept(w.s, r, p, n, len(d), *tokens[i]) if w.ready[i] else n
                    for i, (r, p, n, d) in enumerate(zip(w.batch.reqs, w.batch.prefix_lens, w.own,
                                                         w.drafts))]
            extends.append(self._extend(w, kept, hidden))
        if any(extends):
            self._draft(extends)

    def _sample(self, logits, w: _Verify) -> dict[int, tuple[int, list]]:
        """Per ready request: (drafts accepted, [(token, logprobs)] to append). The plain sampler
        reads every verified position as the request stands there; sampled requests' drafts then
        go through the rejection rule (`spec_sampling.verify_drafts`)."""
        picks = [(i, start + w.own[i] - 1 + j) for i, start, _ in w.fb.token_ranges() if w.ready[i]
                 for j in range(len(w.drafts[i]) + 1)]
        if not picks:
            return {}
        rows = torch.tensor([row for _, row in picks], device=logits.device)
        first = {i: row for i, row in reversed(picks)}
        seen = [as_if_accepted(w.batch.reqs[i], w.drafts[i][:row - first[i]]) for i, row in picks]
        sb = SamplingBatch.from_requests(seen, logits.device)
        picked = logits.index_select(0, rows)
        out = sample_batch(picked, sb, kernels=self.engine.runner.kernels).to_host(sb.top_logprobs)
        tokens: dict[int, list] = {}
        for (i, _), token in zip(picks, out):
            tokens.setdefault(i, []).append(token)
        rule = [(k, i, row - first[i]) for k, (i, row) in enumerate(picks) if row - first[i] < len(w.q[i])]
        verdicts: dict[int, list] = {}
        if rule:
            found = verify_drafts(picked[[k for k, _, _ in rule]], [seen[k] for k, _, _ in rule],
                                  [w.drafts[i][j] for _, i, j in rule],
                                  torch.stack([w.q[i][j] for _, i, j in rule]))
            for (_, i, _), verdict in zip(rule, zip(*found)):
                verdicts.setdefault(i, []).append(verdict)
        return {i: self._outcome(w.drafts[i], ts, verdicts.get(i)) for i, ts in tokens.items()}

    @staticmethod
    def _outcome(draft: list[int], tokens: list, verdicts: list | None) -> tuple[int, list]:
        """Greedy (no verdicts): the longest prefix of drafts equal to the sampler's tokens, then
        its next. Sampled: drafts while accepted, then the residual draw at the first rejection
        or, all accepted, the sampler's bonus token; logprobs are the target's for what is emitted."""
        if verdicts is None:
            accepted = 0
            while accepted < len(draft) and draft[accepted] == tokens[accepted][0]:
                accepted += 1
            return accepted, tokens[:accepted + 1]
        emitted = []
        for j, (ok, residual, logprob_draft, logprob_residual) in enumerate(verdicts):
            if not ok:
                return j, emitted + [(residual, with_logprob(tokens[j][1], logprob_residual))]
            emitted.append((draft[j], with_logprob(tokens[j][1], logprob_draft)))
        return len(draft), emitted + [tokens[len(draft)]]

    def _accept(self, s: Scheduler, req: Request, start: int, num_own: int, num_draft: int,
                accepted: int, emitted: list) -> int:
        """Append the accepted drafts and the target's token after them, roll the KV back to
        them; -> target positions of this step whose KV is kept."""
        s.rollback(req, start + num_own + accepted)
        if num_draft:
            self.engine.metrics.verify(num_draft, accepted)
        for token, logprobs in emitted:
            self.engine.append_token(req, token, logprobs)
            if req.finished:
                break
        if not req.finished:
            s.offer_pages(req)
        return num_own + accepted

    @staticmethod
    def _extend(w: _Verify, kept: list[int], hidden: torch.Tensor) -> _Extend | None:
        """The draft-extend of a rank's unfinished requests over the positions the target kept:
        the token one further at each, with the target's hidden state there."""
        idx = [i for i, r in enumerate(w.batch.reqs) if not r.finished]
        if not idx:
            return None
        reqs, starts, ranges = w.batch.reqs, w.batch.prefix_lens, w.fb.token_ranges()
        fb = ForwardBatch.build("extend", [reqs[i].all_ids[starts[i] + 1:starts[i] + kept[i] + 1]
                                           for i in idx], [reqs[i].row for i in idx],
                                [starts[i] for i in idx], w.s.req_pool.table)
        rows = torch.cat([torch.arange(ranges[i][1], ranges[i][1] + kept[i]) for i in idx])
        return _Extend(w.s, [reqs[i] for i in idx], fb, hidden.index_select(0, rows.to(hidden.device)))

    def _draft(self, extends: list[_Extend | None]) -> None:
        """Draft-extend on every DP rank; requests whose next token is pending then get a chain
        of drafts (as many as they may still generate and their pages allow)."""
        some = next(x.hidden for x in extends if x)
        empty = some.new_zeros(0, some.shape[1])
        outs = self.engine.runner.draft_dp([x.fb if x else idle for x, idle in zip(extends, self._idle())],
                                           [x.hidden if x else empty for x in extends])
        lengths, hiddens = {}, {}   # per drafting request: its draft length, the MTP hidden state
        for x, (logits, out) in zip(extends, outs):
            if x is None:
                continue
            last = (torch.cumsum(x.fb.extend_lens, 0) - 1).to(logits.device)
            for j, req in enumerate(x.reqs):
                length = min(self.num_steps, req.max_total_tokens - req.num_tokens)
                if (req.num_pending == 1 and length > 0
                        and x.s.reserve(req, req.num_computed + length + 1)):
                    lengths[req], hiddens[req] = length, out[last[j]]
            drafting = [j for j, req in enumerate(x.reqs) if req in lengths]
            if drafting:
                rows = last[torch.tensor(drafting, device=last.device)]
                self._add_drafts([x.reqs[j] for j in drafting], logits.index_select(0, rows))
        self._chain(lengths, hiddens, empty)

    def _add_drafts(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Append one draft per request from the MTP layer's logits (`spec_sampling.draw_drafts`:
        the argmax, or for sampled requests a draw from q, whose row is kept for the verify)."""
        tokens, q_rows = draw_drafts(logits, [as_if_accepted(r, r.draft_ids) for r in reqs])
        for r, token, q in zip(reqs, tokens, q_rows):
            r.draft_ids.append(token)
            if q is not None:
                self.draft_q.setdefault(r, []).append(q)

    def _chain(self, lengths: dict, hiddens: dict, empty: torch.Tensor) -> None:
        """Draft steps 1..N-1 on every DP rank: each request's last draft at its position, fed the
        MTP layer's own hidden state from the step before; writes MTP KV on the pages `reserve`
        gave."""
        ranks = self.engine.scheduler.ranks
        for k in range(1, self.num_steps):
            live = [[r for r, n in lengths.items() if n > k and r.dp_rank == d]
                    for d in range(len(ranks))]
            if not any(live):
                return
            fbs = [ForwardBatch.build("extend", [[r.draft_ids[-1]] for r in rs], [r.row for r in rs],
                                      [r.num_computed - 1 + k for r in rs], s.req_pool.table)
                   if rs else ForwardBatch.idle(s.req_pool.table) for s, rs in zip(ranks, live)]
            outs = self.engine.runner.draft_dp(
                fbs, [torch.stack([hiddens[r] for r in rs]) if rs else empty for rs in live])
            for rs, (logits, out) in zip(live, outs):
                if rs:
                    self._add_drafts(rs, logits)
                for j, r in enumerate(rs):
                    hiddens[r] = out[j]
