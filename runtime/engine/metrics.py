"""Serving metrics, exported with `prometheus-client` (one registry per engine).

The engine thread records events (`step`, `token`, `finish`, gauges); `GET /metrics` serves
`exposition()`, the Prometheus text format every scraper reads. Derived gauges (throughput over
the last 10 s, prefix-cache hit rate) are computed when scraped. `counters`, `finished` and
`admitted_by_dp_rank` read the current values back (tests, benchmarks).
"""
from __future__ import annotations

import threading
import time
from collections import deque

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

prometheus_client.disable_created_metrics()  # no `*_created` series: nobody graphs them

PREFIX = "glmc_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)


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
        "spec_verify_steps_total": "Speculative decoding: drafts verified (one per request per step).",
        "spec_draft_tokens_total": "Speculative decoding: draft tokens the MTP layer proposed.",
        "spec_accepted_tokens_total": "Speculative decoding: draft tokens the target accepted.",
    }
    GAUGES = {
        "num_requests_waiting": "Requests in the waiting queue.",
        "num_requests_running": "Requests in the running batch.",
        "kv_pages_total": "Pages in the KV pool (64 tokens each, main and indexer cache).",
        "kv_pages_used": "Pages held by requests.",
        "kv_pages_cached": "Pages held by the prefix cache.",
        "kv_usage_ratio": "Fraction of KV pages held by requests (pages only the prefix cache "
                          "holds are evicted as needed: not counted).",
        "kernel_binaries_compiled": "Triton binaries compiled in this process (GPU plans); a rise "
                                    "while serving is a request that waited for a compile.",
    }
    DERIVED = {
        "prefix_cache_hit_rate": "Prefix-cache hit tokens / prompt tokens, since start.",
        "generation_tokens_per_second": "Generated tokens per second over the last 10 seconds.",
    }
    HISTOGRAMS = {
        "time_to_first_token_seconds": "Time from arrival to the first generated token.",
        "inter_token_latency_seconds": "Time between consecutive tokens of a request.",
        "e2e_request_latency_seconds": "Time from arrival to the last token.",
    }
    WINDOW_S = 10.0
    ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8)

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self._counters = {n: Counter(PREFIX + n, h, registry=r) for n, h in self.COUNTERS.items()}
        self._gauges = {n: Gauge(PREFIX + n, h, registry=r) for n, h in self.GAUGES.items()}
        self._histograms = {n: Histogram(PREFIX + n, h, buckets=LATENCY_BUCKETS, registry=r)
                            for n, h in self.HISTOGRAMS.items()}
        self._accept_length = Histogram(
            PREFIX + "spec_accept_length", "Speculative decoding: tokens a verify step yields per "
            "request (accepted drafts + 1).", buckets=self.ACCEPT_BUCKETS, registry=r)
        self._finished = Counter(PREFIX + "requests_finished_total",
                                 "Finished requests by finish_reason.", ["finish_reason"],
                                 registry=r)
        self._cycles = Counter(PREFIX + "spec_cycles_total", "Speculative decoding: cycles by how they "
                               "ran: chained (queued from the cycle before's outputs on the device, before "
                               "its read), device (whole on the device, one read), general (phase by "
                               "phase: sampled requests, logprobs, grammars, prompts' chunks alone).",
                               ["path"], registry=r)
        self._admitted = Counter(PREFIX + "requests_admitted_total", "Admissions (first and after "
                                 "retraction) by attention-DP rank.", ["dp_rank"], registry=r)
        Gauge(PREFIX + "prefix_cache_hit_rate", self.DERIVED["prefix_cache_hit_rate"],
              registry=r).set_function(self._hit_rate)
        Gauge(PREFIX + "generation_tokens_per_second", self.DERIVED[
            "generation_tokens_per_second"], registry=r).set_function(self._throughput)
        self._lock = threading.Lock()  # guards the throughput window
        self._recent: deque[float] = deque()

    def inc(self, name: str, value: int = 1) -> None:
        self._counters[name].inc(value)

    def observe(self, name: str, value: float) -> None:
        self._histograms[name].observe(value)

    def set_gauges(self, **values: float) -> None:
        for name, value in values.items():
            self._gauges[name].set(value)

    # -- engine events (duck-typed `Request`s and `ScheduledBatch`es) ------------------------------

    def step(self, batches: list) -> None:
        """One engine step: every DP rank's scheduled batch."""
        self.inc("steps_total")
        for batch in batches:
            self.inc("requests_retracted_total", len(batch.retracted))
            for req in batch.admitted:
                self._admitted.labels(dp_rank=str(req.dp_rank)).inc()
                self.inc("prompt_tokens_total", req.num_tokens)
                self.inc("prefix_cache_hit_tokens_total", req.num_cached_tokens)
            self.inc("prefill_tokens_total", sum(n for r, n in zip(batch.reqs, batch.extend_lens)
                                                 if not r.is_decoding))

    def token(self, req, num_tokens: int = 1) -> None:
        """`req` just got `num_tokens` tokens at once: TTFT or inter-token latency (0 between the
        tokens of one run: they arrive together), and the throughput window."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.observe("time_to_first_token_seconds", now - req.arrival_time)
        else:
            self.observe("inter_token_latency_seconds", now - req.last_token_time)
        for _ in range(num_tokens - 1):
            self.observe("inter_token_latency_seconds", 0.0)
        req.last_token_time = now
        self.inc("generation_tokens_total", num_tokens)
        with self._lock:
            self._recent.extend([now] * num_tokens)

    def verify(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """A speculative cycle verified each request's draft of `num_drafts[i]` tokens, of which
        the first `num_accepted[i]` held (requests without a draft left out)."""
        self.inc("spec_verify_steps_total", len(num_drafts))
        self.inc("spec_draft_tokens_total", sum(num_drafts))
        self.inc("spec_accepted_tokens_total", sum(num_accepted))
        for n in num_accepted:
            self._accept_length.observe(n + 1)

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify step (accepted drafts + the target's own token); 0 before any."""
        steps = self.value("spec_verify_steps_total")
        return self.value("spec_accepted_tokens_total") / steps + 1 if steps else 0.0

    def finish(self, req, reason: str) -> None:
        self._finished.labels(finish_reason=reason).inc()
        if req.first_token_time is not None:
            self.observe("e2e_request_latency_seconds", time.monotonic() - req.arrival_time)

    # -- reading -----------------------------------------------------------------------------------

    def exposition(self) -> tuple[bytes, str]:
        """The body and content type of a `/metrics` answer."""
        return prometheus_client.generate_latest(self.registry), prometheus_client.CONTENT_TYPE_LATEST

    def render(self) -> str:
        return self.exposition()[0].decode()

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value by its exported name without the prefix (0 if absent)."""
        v = self.registry.get_sample_value(PREFIX + name, labels)
        return 0.0 if v is None else v

    @property
    def counters(self) -> dict[str, int]:
        return {n: int(self.value(n)) for n in self.COUNTERS}

    @property
    def finished(self) -> dict[str, int]:
        return self._by_label(self._finished, "finish_reason", str)

    def cycle(self, path: str) -> None:
        """A speculative cycle ran on `path` ("chained", "device" or "general")."""
        self._cycles.labels(path=path).inc()

    @property
    def cycles(self) -> dict[str, int]:
        return self._by_label(self._cycles, "path", str)

    @property
    def admitted_by_dp_rank(self) -> dict[int, int]:
        return self._by_label(self._admitted, "dp_rank", int)

    @staticmethod
    def _by_label(counter: Counter, label: str, key) -> dict:
        return {key(s.labels[label]): int(s.value) for metric in counter.collect()
                for s in metric.samples if s.name.endswith("_total")}

    def _hit_rate(self) -> float:
        prompt = self.value("prompt_tokens_total")
        return self.value("prefix_cache_hit_tokens_total") / prompt if prompt else 0.0

    def _throughput(self) -> float:
        cutoff = time.monotonic() - self.WINDOW_S
        with self._lock:
            while self._recent and self._recent[0] < cutoff:
                self._recent.popleft()
            return len(self._recent) / self.WINDOW_S
