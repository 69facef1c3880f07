"""The engines' own state in every step's record, from each server's Prometheus `/metrics` (vLLM's, passed through
by the gate): KV-cache usage, running and waiting requests, preemptions, prefix-cache hit rate, time to first token
and request latency. Gauges are read as they stand; counters and histograms as their change since the last step, so
each step's figures are that step's. vLLM keeps them only with its statistics on (`inference.log_stats`: on with
CUDA, off on CPU by default); a server without them adds nothing to the record."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
GAUGES = {"kv_cache_usage": "vllm:kv_cache_usage_perc", "requests_running": "vllm:num_requests_running",
          "requests_waiting": "vllm:num_requests_waiting"}
COUNTERS = {"preemptions": "vllm:num_preemptions_total", "prefix_cache_queries": "vllm:prefix_cache_queries_total",
            "prefix_cache_hits": "vllm:prefix_cache_hits_total"}
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "latency": "vllm:e2e_request_latency_seconds"}
QUANTILES = (0.5, 0.9)
MAX_LINE = 4096  # no sample line of vLLM's is longer


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Each sample of a Prometheus text exposition, by metric name: (labels, value). Comments and lines that are
    not samples are skipped."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line) if len(line) <= MAX_LINE else None  # the label regex is slow on huge lines
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        if not math.isfinite(number):  # a NaN gauge would freeze the cap
            continue
        samples.setdefault(name, []).append((dict(LABEL.findall(labels or "")), number))
    return samples


@dataclass
class Scrape:
    """One server's figures at one moment: gauges and counters summed over its engines, histograms' cumulative
    bucket counts by upper bound."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)


def scrape_of(text: str) -> Scrape | None:
    """The figures a server's /metrics holds; None where it holds none of vLLM's (its statistics are off)."""
    samples = parse_prometheus(text)
    scrape = Scrape()
    for key, name in GAUGES.items():
        values = [v for _, v in samples.get(name, ()) if v >= 0]  # a negative queue or usage is no reading
        if values:
            scrape.gauges[key] = max(values) if key == "kv_cache_usage" else sum(values)
    for key, name in COUNTERS.items():
        values = [v for _, v in samples.get(name, ()) if v >= 0]
        if values:
            scrape.counters[key] = sum(values)
    for key, name in HISTOGRAMS.items():
        buckets: dict[float, float] = {}
        for labels, value in samples.get(f"{name}_bucket", ()):
            bound = float(labels.get("le", "nan"))
            if not math.isnan(bound):
                buckets[bound] = buckets.get(bound, 0.0) + value
        if buckets:
            scrape.buckets[key] = buckets
    return scrape if scrape.gauges or scrape.counters or scrape.buckets else None


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile of a histogram's cumulative bucket counts, interpolated within its bucket as Prometheus's
    histogram_quantile does; None where it counted nothing. A quantile in the open last bucket is its lower bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, below, lower = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        below, lower = count, bound
    return lower


def change(now: Scrape, before: Scrape | None) -> Scrape:
    """Counters and histograms of `now` less those of `before` (all of them where a server restarted: its counters
    went down); gauges as they stand."""
    if before is None or any(now.counters.get(k, 0.0) < v for k, v in before.counters.items()):
        return now
    counters = {k: v - before.counters.get(k, 0.0) for k, v in now.counters.items()}
    buckets = {k: {b: c - before.buckets.get(k, {}).get(b, 0.0) for b, c in v.items()} for k, v in now.buckets.items()}
    return Scrape(dict(now.gauges), counters, buckets)


class EngineMetrics:
    """Each server's last scrape; `step_stats` turns this step's scrapes into the record's `engine/...` keys."""

    def __init__(self) -> None:
        self.last: dict[int, Scrape] = {}

    def step_stats(self, texts: list[str | Scrape | None]) -> dict:
        """Per server (`engine/<i>/...`) and over all: KV-cache usage (the fullest server's), requests running and
        waiting, preemptions this step, prefix-cache hit rate this step, time to first token and request latency
        p50/p90 this step."""
        stats: dict = {}
        steps = []
        for i, text in enumerate(texts):
            now = scrape_of(text) if isinstance(text, str) else text
            if now is None:
                continue
            step = change(now, self.last.get(i))
            self.last[i] = now
            steps.append(step)
            stats |= {f"engine/{i}/{k}": v for k, v in step.gauges.items()}
            if "preemptions" in step.counters:
                stats[f"engine/{i}/preemptions"] = step.counters["preemptions"]
        if not steps:
            return stats
        for key in GAUGES:
            values = [s.gauges[key] for s in steps if key in s.gauges]
            if values:
                stats[f"engine/{key}"] = max(values) if key == "kv_cache_usage" else sum(values)
        counters = {k: sum(s.counters.get(k, 0.0) for s in steps) for k in COUNTERS}
        stats["engine/preemptions"] = counters["preemptions"]
        if counters["prefix_cache_queries"] > 0:
            stats["engine/prefix_cache_hit_rate"] = counters["prefix_cache_hits"] / counters["prefix_cache_queries"]
        for key in HISTOGRAMS:
            merged: dict[float, float] = {}
            for s in steps:
                for bound, count in s.buckets.get(key, {}).items():
                    merged[bound] = merged.get(bound, 0.0) + count
            for q in QUANTILES:
                if (value := quantile(merged, q)) is not None:
                    stats[f"engine/{key}_p{round(q * 100)}_s"] = value
        return stats
