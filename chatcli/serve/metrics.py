"""The server's Prometheus metrics: what /metrics counts, where it counts it, and its text.

Owns: ServerMetrics (one app's CollectorRegistry, never the global one, so several servers
live in one process; its counters and histograms under vLLM's names with a `chatcli:` prefix,
each with a `model_name` label), MeteredBackend (the Backend every generation of the app goes
through: it reads each request's Finished on its way to the client, so the front counts every
request whichever back end ran it, a Ray cluster's replicas included), the gauges read from
the back end's /stats at each scrape, and the /metrics route (501 with the pip command where
prometheus_client is not installed).

The numbers are the engine's own (GenerationStats, carried in each Finished: decode time,
cached tokens) except two timed here, as a client sees them: time to first token and the
end-to-end latency, each from the request's hand-over to the back end (queueing included). Knows nothing of models or the terminal.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from chatcli.serve.backend import Backend, Item
from chatcli.serve.replies import Finished, GenerationParams
from chatcli.serve.requests import error_body
from chatcli.serve.worker_pool import ShuttingDown, Waiting

PROMETHEUS_EXTRA = "pip install 'chatcli[serve]'"
PREFIX = "chatcli:"
# finished_reason as vLLM labels it: the engine's "context" is a length cut too (OpenAI's
# word), and a request stopped before its end (the client left, the server closed) is
# vLLM's "abort"; "error" is a generation that failed.
FINISHED_REASONS = {"stop": "stop", "length": "length", "context": "length", "interrupted": "abort"}
# Seconds. CPU replies take tens of milliseconds a token and seconds a reply; GPU ones
# milliseconds a token: the buckets span both.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def prometheus_available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class ServerMetrics:
    """One app's metrics. `observe` and `observe_cut` are called on the event loop, once a
    request; the gauges are read from `backend.describe()` when Prometheus scrapes."""

    def __init__(self, backend: Backend, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, registry=self.registry, buckets=buckets)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the finished requests.")
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated for the finished requests."
        )
        self.requests = counter(
            "request_success", "Requests ended, by finished_reason.", ("finished_reason",)
        )
        self.cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the warm caches."
        )
        self.cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in a warm cache, not prefilled."
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "From the request's hand-over to a back end to its first token, queueing included.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Between two tokens of a reply: its decode time over its tokens after the first.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "From the request's hand-over to a back end to its end, queueing included.",
            E2E_BUCKETS,
        )
        self.registry.register(_BackendGauges(backend, model_name))

    def observe(self, finished: Finished, e2e_s: float, first_token_s: float | None) -> None:
        """A request that ran: its tokens, its reason, its timings (`first_token_s` from the
        hand-over to its first token reaching the front; None when none came)."""
        name = self.model_name
        reason = FINISHED_REASONS.get(finished.finish_reason, finished.finish_reason)
        self.requests.labels(name, reason).inc()
        self.e2e.labels(name).observe(e2e_s)
        if reason == "abort":  # its tokens go uncounted, as /stats' tokens_served
            return
        self.prompt_tokens.labels(name).inc(finished.prompt_tokens)
        self.generation_tokens.labels(name).inc(finished.completion_tokens)
        self.cache_queries.labels(name).inc(finished.prompt_tokens)
        self.cache_hits.labels(name).inc(finished.cached_tokens)
        if first_token_s is not None:
            self.ttft.labels(name).observe(first_token_s)
        gaps = finished.completion_tokens - 1
        if gaps >= 1 and finished.decode_s > 0:
            # One observation per gap, each the reply's mean: the histogram's sum is then the
            # decode time and its count the gaps, as a per-token timer's would be.
            itl = self.itl.labels(name)
            for _ in range(gaps):
                itl.observe(finished.decode_s / gaps)

    def observe_cut(self, reason: str, e2e_s: float) -> None:
        """A request that ended without its Finished reaching the app: abort or error."""
        self.requests.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_s)

    def exposition(self) -> tuple[bytes, str]:
        """The text Prometheus scrapes, and its content type."""
        from prometheus_client import exposition

        content_type = getattr(
            exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST
        )
        return exposition.generate_latest(self.registry), content_type


class _BackendGauges:
    """A collector of what the back end's /stats says now: rows running, requests waiting,
    and the fraction of rows (each a KV cache slot) in use."""

    def __init__(self, backend: Backend, model_name: str) -> None:
        self.backend, self.model_name = backend, model_name

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        state = self.backend.describe()
        rows, in_use = state.get("rows", 0), state.get("rows_in_use", 0)
        values = (
            ("num_requests_running", "Requests generating in a worker's row now.", in_use),
            ("num_requests_waiting", "Requests queued for a free row.", state["queue_length"]),
            (
                "kv_cache_usage_perc",
                "Fraction of the rows' KV cache slots in use (0 to 1).",
                in_use / rows if rows else 0.0,
            ),
        )
        for name, doc, value in values:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class MeteredBackend:
    """A Backend that counts each generation of the one it wraps into `metrics`."""

    def __init__(self, backend: Backend, metrics: ServerMetrics) -> None:
        self.backend, self.metrics = backend, metrics

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def context_len(self) -> int:
        return self.backend.context_len

    @property
    def closed(self) -> bool:
        return self.backend.closed

    @property
    def waiting(self) -> int:
        return self.backend.waiting

    def queue_full(self, max_queue: int) -> bool:
        return self.backend.queue_full(max_queue)

    def describe(self) -> dict[str, Any]:
        return self.backend.describe()

    def close(self) -> None:
        self.backend.close()

    async def generate(
        self, prompt: list[int], params: GenerationParams, waiting_every: float | None = None
    ) -> AsyncIterator[Item]:
        started = time.perf_counter()
        # Time to first token as a client waits for it (and as vLLM counts it): from the
        # hand-over, so the time queued for a row and a Ray replica's transport are in it;
        # the engine's own (GenerationStats.first_token_s) starts when a row took the request.
        first_token_s: float | None = None
        ended = False
        cut = "abort"  # closed or cancelled (the client left), or ShuttingDown
        try:
            async for item in self.backend.generate(prompt, params, waiting_every):
                if isinstance(item, Finished):
                    # Counted before the consumer sees it: one that stops at the Finished (a
                    # whole reply) may leave this generator suspended there for good.
                    ended = True
                    self.metrics.observe(item, time.perf_counter() - started, first_token_s)
                elif first_token_s is None and not isinstance(item, Waiting) and item:
                    first_token_s = time.perf_counter() - started
                yield item
        except ShuttingDown:
            raise
        except Exception:
            cut = "error"
            raise
        finally:
            if not ended:
                self.metrics.observe_cut(cut, time.perf_counter() - started)


def add_metrics(app: FastAPI, backend: Backend, model_name: str) -> Backend:
    """GET /metrics on `app`, and the back end its routes should generate through: `backend`
    metered, or as it is where prometheus_client is not installed (then /metrics is a 501
    naming the pip command)."""
    metrics = ServerMetrics(backend, model_name) if prometheus_available() else None

    @app.api_route("/metrics", methods=["GET", "HEAD"], response_model=None)
    async def scrape() -> Response:
        if metrics is None:
            message = f"/metrics needs prometheus_client: {PROMETHEUS_EXTRA}, then restart."
            return JSONResponse(error_body(message, type_="server_error"), status_code=501)
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return backend if metrics is None else MeteredBackend(backend, metrics)
