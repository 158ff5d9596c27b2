"""The server's Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Each server has its own :class:`CollectorRegistry` (no global state). Counters are totals
since start (a rate is Prometheus's ``rate()``); the gauges are read when scraped:

- ``specgguf_requests_total{endpoint, status}``: HTTP requests answered;
- ``specgguf_prompt_tokens_total``, ``specgguf_tokens_generated_total``,
  ``specgguf_draft_tokens_total``, ``specgguf_draft_tokens_accepted_total``: token counts
  of finished generations (cancelled ones included);
- ``specgguf_generation_seconds_total``: time spent generating (prompt excluded);
- ``specgguf_acceptance_rate``: accepted / drafted draft tokens since start;
- ``specgguf_tokens_per_second``: generated tokens / generation seconds since start, and
  ``specgguf_last_tokens_per_second`` of the latest generation;
- ``specgguf_queue_length``: requests waiting; ``specgguf_requests_running``: 0 to ``--parallel``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from specgguf.speculative.loop import GenerationResult


class Metrics:
    """Counters and gauges of one server; ``queue_length`` and ``running`` are read at
    scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_length: Callable[[], int], running: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "specgguf_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "specgguf_prompt_tokens", "Prompt tokens processed", registry=r
        )
        self.generated = Counter(
            "specgguf_tokens_generated", "Tokens generated (output)", registry=r
        )
        self.drafted = Counter(
            "specgguf_draft_tokens", "Draft tokens sent to verification", registry=r
        )
        self.accepted = Counter(
            "specgguf_draft_tokens_accepted", "Draft tokens the target accepted", registry=r
        )
        self.seconds = Counter(
            "specgguf_generation_seconds", "Seconds spent generating (prompt excluded)",
            registry=r,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._drafted = self._accepted = self._generated = 0
        self._seconds = 0.0
        self._last_rate = 0.0
        gauges = {
            "specgguf_acceptance_rate": ("Accepted / drafted draft tokens since start",
                                         lambda: self._ratio(self._accepted, self._drafted)),
            "specgguf_tokens_per_second": ("Generated tokens per generation second since start",
                                           lambda: self._ratio(self._generated, self._seconds)),
            "specgguf_last_tokens_per_second": ("Tokens per second of the latest generation",
                                                lambda: self._last_rate),
            "specgguf_queue_length": ("Requests waiting", lambda: float(queue_length())),
            "specgguf_requests_running": ("Requests generating now", lambda: float(running())),
        }  # fmt: skip
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(read)

    @staticmethod
    def _ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    def observe(self, result: GenerationResult) -> None:
        """Count a finished generation (any thread)."""
        s = result.stats
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generated.inc(s.generated)
        self.drafted.inc(s.drafted)
        self.accepted.inc(s.accepted)
        self.seconds.inc(s.seconds)
        with self._lock:
            self._generated += s.generated
            self._drafted += s.drafted
            self._accepted += s.accepted
            self._seconds += s.seconds
            self._last_rate = s.tokens_per_s

    def render(self) -> bytes:
        """The Prometheus text exposition format."""
        return generate_latest(self.registry)
