"""Prometheus metrics for the server, written in the text exposition format (no extra dependency).

Counters, gauges and histograms with labels, one registry per app. Gauges may be callbacks read at
scrape time (queue length per model, GPU bytes allocated).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple, values: tuple, extra: str = "") -> str:
    parts = [f'{n}="{_esc(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    v = float(v)
    if v == math.inf:
        return "+Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)


class _Metric:
    kind = ""

    def __init__(self, name: str, doc: str, labels: Iterable[str] = ()):
        self.name, self.doc, self.labelnames = name, doc, tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = tuple(str(labels[n]) for n in self.labelnames)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels) -> float:
        return self.values.get(tuple(str(labels[n]) for n in self.labelnames), 0.0)

    def render(self) -> list[str]:
        # Prometheus counters are exposed with the _total suffix (the metric name carries it).
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}"
                                for k, v in sorted(self.values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name, doc, labels=(), fn: Callable[[], dict[tuple, float]] | None = None):
        super().__init__(name, doc, labels)
        self.fn = fn
        self.values: dict[tuple, float] = {}

    def set(self, value: float, **labels) -> None:
        self.values[tuple(str(labels[n]) for n in self.labelnames)] = value

    def render(self) -> list[str]:
        vals = self.fn() if self.fn is not None else self.values
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}"
                                for k, v in sorted(vals.items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, doc, labels=(), buckets: Iterable[float] = ()):
        super().__init__(name, doc, labels)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self.series: dict[tuple, list] = {}     # key -> [bucket counts..., sum, count]

    def observe(self, value: float, **labels) -> None:
        key = tuple(str(labels[n]) for n in self.labelnames)
        s = self.series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
        for i, b in enumerate(self.buckets):
            if value <= b:
                s[i] += 1
        s[-2] += value
        s[-1] += 1

    def count(self, **labels) -> int:
        s = self.series.get(tuple(str(labels[n]) for n in self.labelnames))
        return s[-1] if s else 0

    def render(self) -> list[str]:
        out = self.header()
        for key, s in sorted(self.series.items()):
            for i, b in enumerate(self.buckets):
                le = 'le="' + _num(b) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {s[i]}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_num(s[-2])}")
            out.append(f"{self.name}_count{_labels(self.labelnames, key)} {s[-1]}")
        return out


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """The server's metrics. `queue_fn()` -> {model: waiting+running}; `gpu_fn()` -> {owner: bytes}."""

    def __init__(self, queue_fn: Callable[[], dict], gpu_fn: Callable[[], dict]):
        self.requests = Counter("webgpu_engine_requests_total", "HTTP requests by endpoint and status.",
                                ("endpoint", "status"))
        self.prompt_tokens = Counter("webgpu_engine_prompt_tokens_total", "Prompt tokens processed.",
                                     ("model",))
        self.completion_tokens = Counter("webgpu_engine_completion_tokens_total",
                                         "Completion tokens generated.", ("model",))
        self.ttft = Histogram("webgpu_engine_time_to_first_token_seconds",
                              "Time from request start to the first generated token.", ("model",),
                              _LATENCY_BUCKETS)
        self.tpot = Histogram("webgpu_engine_time_per_output_token_seconds",
                              "Mean time per generated token after the first.", ("model",),
                              (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.latency = Histogram("webgpu_engine_request_duration_seconds",
                                 "Request duration by endpoint.", ("endpoint",), _LATENCY_BUCKETS)
        self.queue = Gauge("webgpu_engine_queue_length", "Requests waiting for or running on a model.",
                           ("model",), fn=lambda: {(m,): v for m, v in queue_fn().items()})
        self.gpu = Gauge("webgpu_engine_gpu_allocated_bytes", "GPU memory allocated, by owner.",
                         ("owner",), fn=lambda: {(o,): v for o, v in gpu_fn().items()})
        self._all = [self.requests, self.prompt_tokens, self.completion_tokens, self.ttft, self.tpot,
                     self.latency, self.queue, self.gpu]

    def observe_usage(self, model: str, usage: dict | None) -> None:
        if not usage:
            return
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0), model=model)
        self.completion_tokens.inc(usage.get("completion_tokens", 0), model=model)
        extra = usage.get("extra") or {}
        if extra.get("time_to_first_token_s") is not None:
            self.ttft.observe(float(extra["time_to_first_token_s"]), model=model)
        if extra.get("time_per_output_token_s") is not None and usage.get("completion_tokens", 0) > 1:
            self.tpot.observe(float(extra["time_per_output_token_s"]), model=model)

    def render(self) -> str:
        lines = []
        for m in self._all:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
