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
- ``specgguf_queue_length``: requests waiting; ``specgguf_requests_running``: 0 to ``--parallel``;
- ``specgguf_prompt_tokens_cached_total`` and ``specgguf_prompt_tokens_read_total``: prompt
  tokens reused from a sequence's cache and read (``prompt_tokens`` is their sum);
  ``specgguf_prompt_cache_hits_total`` and ``specgguf_prompt_cache_misses_total``:
  generations that reused some of their prompt, and none of it;
- with a prompt cache (``--cache-ram``, ``--cache-dir``): ``specgguf_prompt_cache_bytes``
  and ``specgguf_prompt_cache_disk_bytes`` held, ``specgguf_prompt_cache_entries``,
  ``specgguf_prompt_cache_saves_total`` (sequences saved before another prompt took them)
  and ``specgguf_prompt_cache_restores_total`` (saved prompts given back to a sequence).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from specgguf.speculative.loop import GenerationResult

if TYPE_CHECKING:
    from specgguf.engine.prompt_cache import PromptCache


class _CacheCollector(Collector):
    """The prompt cache's sizes and totals, read when scraped (the engine's thread writes
    them: a scrape may see them a step old)."""

    def __init__(self, cache: PromptCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        c = self.cache
        for name, doc, value in (
            ("specgguf_prompt_cache_bytes", "Bytes of saved prompts in host memory", c.nbytes),
            ("specgguf_prompt_cache_disk_bytes", "Bytes of saved prompts on disk", c.disk_bytes),
            ("specgguf_prompt_cache_entries", "Saved prompts held", len(c)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("specgguf_prompt_cache_saves",
                                  "Sequences saved before another prompt took them",
                                  value=c.saves)  # fmt: skip
        yield CounterMetricFamily("specgguf_prompt_cache_restores",
                                  "Saved prompts given back to a sequence",
                                  value=c.restores)  # fmt: skip


class Metrics:
    """Counters and gauges of one server; ``queue_length`` and ``running`` are read at
    scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        queue_length: Callable[[], int],
        running: Callable[[], int],
        prompt_cache: PromptCache | None = None,
    ) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "specgguf_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "specgguf_prompt_tokens", "Prompt tokens (reused and read)", registry=r
        )
        self.prompt_cached = Counter(
            "specgguf_prompt_tokens_cached", "Prompt tokens reused from a sequence's cache",
            registry=r,
        )  # fmt: skip
        self.prompt_read = Counter(
            "specgguf_prompt_tokens_read", "Prompt tokens read (evaluated)", registry=r
        )
        self.cache_hits = Counter(
            "specgguf_prompt_cache_hits", "Generations that reused some of their prompt",
            registry=r,
        )  # fmt: skip
        self.cache_misses = Counter(
            "specgguf_prompt_cache_misses", "Generations that reused none of their prompt",
            registry=r,
        )  # fmt: skip
        if prompt_cache is not None:
            r.register(_CacheCollector(prompt_cache))
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
        self.prompt_cached.inc(s.prompt_cached)
        self.prompt_read.inc(s.prompt_read)
        (self.cache_hits if s.prompt_cached else self.cache_misses).inc()
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
