"""Serving metrics in Prometheus text format (no client library: a few counters and histograms).

The engine thread records events; the server renders `Metrics.render()` for `GET /metrics`. A lock
keeps a render from seeing half an update.
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import deque

PREFIX = "glmc_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)


class Histogram:
    """Cumulative-bucket histogram, rendered the way Prometheus expects."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, total = [], 0
        for le, c in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += c
            lines.append(f'{name}_bucket{{le="{le}"}} {total}')
        return lines + [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class Metrics:
    """Counters, gauges and histograms of one engine."""

    COUNTERS = {
        "prompt_tokens_total": "Prompt tokens of admitted requests (resumed requests count again).",
        "prefill_tokens_total": "Prompt tokens actually computed (prefix-cache hits excluded).",
        "prefix_cache_hit_tokens_total": "Prompt tokens served from the prefix cache.",
        "generation_tokens_total": "Tokens generated.",
        "requests_retracted_total": "Requests retracted because the KV pool ran out.",
        "requests_rejected_total": "Requests answered with an error status (bad input, overload).",
        "steps_total": "Forward steps run.",
    }
    GAUGES = {
        "num_requests_waiting": "Requests in the waiting queue.",
        "num_requests_running": "Requests in the running batch.",
        "kv_pages_total": "Pages in the KV pool (64 tokens each, main and indexer cache).",
        "kv_pages_used": "Pages held by requests.",
        "kv_pages_cached": "Pages held by the prefix cache.",
        "kv_usage_ratio": "Fraction of KV pages in use (held by requests or the prefix cache).",
        "prefix_cache_hit_rate": "Prefix-cache hit tokens / prompt tokens, since start.",
        "generation_tokens_per_second": "Generated tokens per second over the last 10 seconds.",
    }
    HISTOGRAMS = {
        "time_to_first_token_seconds": "Time from arrival to the first generated token.",
        "inter_token_latency_seconds": "Time between consecutive tokens of a request.",
        "e2e_request_latency_seconds": "Time from arrival to the last token.",
    }
    WINDOW_S = 10.0

    def __init__(self):
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.gauges = dict.fromkeys(self.GAUGES, 0.0)
        self.histograms = {name: Histogram() for name in self.HISTOGRAMS}
        self.finished: dict[str, int] = {}
        self.admitted_by_dp_rank: dict[int, int] = {}  # attention-DP balance
        self._recent: deque[tuple[float, int]] = deque()

    def inc(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.counters[name] += value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.histograms[name].observe(value)

    # -- engine events (duck-typed `Request`s and `ScheduledBatch`es) ------------------------------

    def step(self, batches: list) -> None:
        """One engine step: every DP rank's scheduled batch."""
        self.inc("steps_total")
        for batch in batches:
            self.inc("requests_retracted_total", len(batch.retracted))
            for req in batch.admitted:
                self._admit(req.dp_rank)
                self.inc("prompt_tokens_total", req.num_tokens)
                self.inc("prefix_cache_hit_tokens_total", req.num_cached_tokens)
            self.inc("prefill_tokens_total", sum(n for r, n in zip(batch.reqs, batch.extend_lens)
                                                 if not r.is_decoding))

    def token(self, req) -> None:
        """`req` just got a token: TTFT or inter-token latency, and the throughput window."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.observe("time_to_first_token_seconds", now - req.arrival_time)
        else:
            self.observe("inter_token_latency_seconds", now - req.last_token_time)
        req.last_token_time = now
        with self._lock:
            self.counters["generation_tokens_total"] += 1
            self._recent.append((now, 1))

    def finish(self, req, reason: str) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
        if req.first_token_time is not None:
            self.observe("e2e_request_latency_seconds", time.monotonic() - req.arrival_time)

    def _admit(self, dp_rank: int) -> None:
        with self._lock:
            self.admitted_by_dp_rank[dp_rank] = self.admitted_by_dp_rank.get(dp_rank, 0) + 1

    def set_gauges(self, **values: float) -> None:
        with self._lock:
            self.gauges.update(values)

    def render(self) -> str:
        with self._lock:
            self._update_derived()
            out = []
            for kind, table, values in (("counter", self.COUNTERS, self.counters),
                                        ("gauge", self.GAUGES, self.gauges)):
                for name, help_ in table.items():
                    out += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}",
                            f"{PREFIX}{name} {values[name]:g}"]
            out += [f"# HELP {PREFIX}requests_finished_total Finished requests by finish_reason.",
                    f"# TYPE {PREFIX}requests_finished_total counter"]
            out += [f'{PREFIX}requests_finished_total{{finish_reason="{r}"}} {n}'
                    for r, n in sorted(self.finished.items())]
            out += [f"# HELP {PREFIX}requests_admitted_total Admissions (first and after "
                    "retraction) by attention-DP rank.", f"# TYPE {PREFIX}requests_admitted_total counter"]
            out += [f'{PREFIX}requests_admitted_total{{dp_rank="{r}"}} {n}'
                    for r, n in sorted(self.admitted_by_dp_rank.items())]
            for name, help_ in self.HISTOGRAMS.items():
                out += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} histogram"]
                out += self.histograms[name].render(PREFIX + name)
            return "\n".join(out) + "\n"

    def _update_derived(self) -> None:
        c, now = self.counters, time.monotonic()
        while self._recent and self._recent[0][0] < now - self.WINDOW_S:
            self._recent.popleft()
        self.gauges["generation_tokens_per_second"] = sum(n for _, n in self._recent) / self.WINDOW_S
        self.gauges["prefix_cache_hit_rate"] = (
            c["prefix_cache_hit_tokens_total"] / c["prompt_tokens_total"]
            if c["prompt_tokens_total"] else 0.0)
