"""Standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for the sampled
requests (temperature > 0) of the MTP speculator (`speculative.py`).

Draft: the MTP layer's logits for the token at counter c go through the plain sampler's own
processing for the request as it would stand there (`sampling.probabilities` of `as_if_accepted`:
logit bias, penalties over the history with the earlier drafts, temperature, top-k, top-p, min-p),
giving q; the draft d is drawn from q and the q row is kept until the verify step.
Verify, position j (counter c): p = `sampling.probabilities` of the target's logits there, same
request state; d is accepted with probability min(1, p(d) / q(d)) (u * q(d) < p(d), u uniform);
the first rejected draft is replaced by a draw from normalize(max(0, p - q)) and the rest dropped;
when every draft holds, the bonus token is the plain sampler's draw from p (`sample_batch`).

Why the output is the plain sampler's distribution: whatever q is, P(emit x) = min(p(x), q(x))
+ (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = p(x), since
both sums equal 1 - sum_y min(p, q); given an accepted draft, the next draft was drawn from the q
of that longer prefix, so the argument repeats position by position. Exactness needs only that d
was really drawn from the q used in the test; processing q exactly as p (penalties and bias
included) is a choice that makes q closest to p, which is what raises acceptance.
Greedy requests keep the MTP layer's argmax and exact matching (the rule with p a point mass).
Structured outputs: p is masked by the request's grammar advanced through the drafts before the
position (`grammar.token_bitmask`), so a draft the grammar forbids has p = 0 and is always rejected,
and the residual draw only gives allowed tokens; q is masked the same way, which keeps drafts
inside the grammar (any q keeps the output exact).

Randomness: u_i = `torch_ref.sample_uniform(seed ^ stream, counter, V)`, the plain sampler's
counter-based hash, with the request's seed XOR a constant per stream (draft draw, acceptance coin,
residual draw; the bonus token uses the plain sampler's own stream): a pure function of (seed,
counter), so a seeded request draws the same whatever shares its batch. A counter's coin and
residual are used once (that position is then emitted); a draft drawn for a counter that a
rejection before it discarded is drawn again with the same noise, which is sound because the
discarded draft influenced nothing emitted. Probabilities are fp32 whatever the logits' dtype.
"""
from __future__ import annotations

import torch
from glmc.codegen.torch_ref import sample_uniform
from glmc.runtime.engine.grammar import allowed_tokens, token_bitmask
from glmc.runtime.engine.sampling import Sampled, SamplingBatch, probabilities
from glmc.runtime.worker.forward_batch import to_device


def _int64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


# XORed into the seed, halves distinct from each other and from 0, so that the streams' keys differ
DRAFT_STREAM = _int64(0x9E3779B97F4A7C15)
ACCEPT_STREAM = _int64(0xBF58476D1CE4E5B9)
RESIDUAL_STREAM = _int64(0x94D049BB133111EB)


def race(probs: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, stream: int) -> torch.Tensor:
    """One token per row of probs [B, V] (fp32, rows summing to 1 over their support), drawn with
    those probabilities by an exponential race on log p with the noise of (seed ^ stream, step)."""
    noise = torch.log(-torch.log(sample_uniform(seed ^ stream, step, probs.shape[1])))
    return torch.where(probs > 0, torch.log(probs) - noise, float("-inf")).argmax(-1)


def draw_drafts(logits: torch.Tensor, reqs: list[Sampled]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Draft tokens [B] (int64, on the logits' device: nothing is read back) from the MTP layer's
    logits [B, V], row i for reqs[i] as the sampler would see it at that draft's counter
    (`as_if_accepted`): greedy requests the argmax, as before; sampled ones a draw from q, whose
    row ([V] fp32) comes back with it (None for greedy rows). A request with a grammar drafts only
    what its grammar allows after the drafts before (its q is 0 elsewhere), so its drafts are not
    wasted on tokens the target's mask would reject."""
    bitmask = token_bitmask(reqs)
    if bitmask is not None:
        allowed = allowed_tokens(to_device(bitmask, logits.device), logits.shape[1])
        logits = logits.float().masked_fill(~allowed, float("-inf"))
    tokens = logits.argmax(-1)
    q_rows: list[torch.Tensor | None] = [None] * len(reqs)
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if sampled:
        idx = to_device(torch.tensor(sampled), logits.device)
        batch = SamplingBatch.from_requests([reqs[i] for i in sampled], logits.device)
        q = probabilities(logits.index_select(0, idx), batch)
        tokens = tokens.index_copy(0, idx, race(q, batch.seed, batch.step, DRAFT_STREAM))
        for j, i in enumerate(sampled):
            q_rows[i] = q[j]
    return tokens, q_rows


def verify_drafts(logits: torch.Tensor, reqs: list[Sampled], drafts: torch.Tensor, q: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule at M draft positions: target logits [M, V], the request as the sampler
    sees it there, the draft tokens [M] (int64, the logits' device) and their q rows [M, V].
    -> per position, on the device (no read-back, no data-dependent shapes): accepted? [M] bool,
    and the token to emit there [M] int64 (the draft where accepted, else the residual draw)."""
    batch = SamplingBatch.from_requests(reqs, logits.device)
    p = probabilities(logits, batch)
    d = drafts[:, None]
    coin = sample_uniform(batch.seed ^ ACCEPT_STREAM, batch.step, 1)[:, 0]
    accept = coin * q.gather(1, d)[:, 0] < p.gather(1, d)[:, 0]   # u < p(d) / q(d); q(d) > 0
    residual = (p - q).clamp_min(0.0)   # drawn for every row, used where rejected
    # p == q up to rounding leaves nothing: rejection then had probability ~0; p is the answer
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    drawn = race(residual / residual.sum(-1, keepdim=True), batch.seed, batch.step, RESIDUAL_STREAM)
    return accept, torch.where(accept, drafts, drawn)
