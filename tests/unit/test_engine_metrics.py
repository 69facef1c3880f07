"""The engines' figures in each step's record (rl/orchestrator/engine_metrics.py), from Prometheus text as vLLM
writes it: gauges as they stand, counters and histograms as their change over the step."""

import pytest

from rl.orchestrator.engine_metrics import EngineMetrics, parse_prometheus, quantile, scrape_of


def exposition(kv=0.25, running=3, waiting=1, preemptions=0, queries=100, hits=40, ttft=(0, 2, 4, 4), engine="0"):
    """vLLM's /metrics in its shape: TTFT counts cumulative over le = 0.1, 0.5, 1, +Inf."""
    labels = f'engine="{engine}",model_name="m"'
    lines = [
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
        f"vllm:num_requests_running{{{labels}}} {running}",
        f"vllm:num_requests_waiting{{{labels}}} {waiting}",
        f"vllm:num_preemptions_total{{{labels}}} {preemptions}",
        f"vllm:prefix_cache_queries_total{{{labels}}} {queries}",
        f"vllm:prefix_cache_hits_total{{{labels}}} {hits}",
        'http_requests_total{handler="/inference/v1/generate",method="POST",status="2xx"} 12.0',
    ]
    for bound, count in zip(("0.1", "0.5", "1.0", "+Inf"), ttft):
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{bound}"}} {count}')
    lines.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {ttft[-1]}")
    return "\n".join(lines) + "\n"


def test_prometheus_text_is_parsed_by_name_and_labels():
    samples = parse_prometheus(exposition())
    assert samples["vllm:kv_cache_usage_perc"] == [({"engine": "0", "model_name": "m"}, 0.25)]
    assert samples["http_requests_total"][0][0]["handler"] == "/inference/v1/generate"
    assert [labels["le"] for labels, _ in samples["vllm:time_to_first_token_seconds_bucket"]] == [
        "0.1", "0.5", "1.0", "+Inf"]


def test_quantiles_interpolate_within_their_bucket():
    buckets = {0.1: 0.0, 0.5: 2.0, 1.0: 4.0, float("inf"): 4.0}
    assert quantile(buckets, 0.5) == pytest.approx(0.5)  # rank 2 of 4: the top of the (0.1, 0.5] bucket
    assert quantile(buckets, 0.25) == pytest.approx(0.3)  # rank 1: halfway through it
    assert quantile({1.0: 1.0, float("inf"): 3.0}, 0.9) == 1.0  # in the open last bucket: its lower bound
    assert quantile({1.0: 0.0, float("inf"): 0.0}, 0.5) is None


def test_each_step_reports_gauges_as_they_stand_and_counters_over_the_step():
    metrics = EngineMetrics()
    first = metrics.step_stats([exposition(preemptions=2), None])  # the second server did not answer
    assert first["engine/kv_cache_usage"] == 0.25 and first["engine/requests_waiting"] == 1
    assert first["engine/preemptions"] == 2 and first["engine/prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert first["engine/ttft_p50_s"] == pytest.approx(0.5) and "engine/1/kv_cache_usage" not in first
    second = metrics.step_stats([exposition(kv=0.9, preemptions=5, queries=200, hits=130, ttft=(0, 2, 4, 8)),
                                 exposition(kv=0.5, running=1, waiting=4, engine="0")])
    assert second["engine/kv_cache_usage"] == 0.9  # the fullest server's
    assert second["engine/0/preemptions"] == 3 and second["engine/preemptions"] == 3  # over this step only
    assert second["engine/requests_waiting"] == 5 and second["engine/1/requests_waiting"] == 4
    # this step's queries: 100 on server 0 (90 hits), and server 1's first scrape counts whole (100, 40)
    assert second["engine/prefix_cache_hit_rate"] == pytest.approx((90 + 40) / 200)
    # this step's TTFTs on server 0: 4 new ones past 1 s; on server 1, its 4 first ones
    assert second["engine/ttft_p90_s"] == 1.0


def test_a_restarted_server_counts_whole_and_a_server_without_statistics_adds_nothing():
    metrics = EngineMetrics()
    metrics.step_stats([exposition(preemptions=7)])
    assert metrics.step_stats([exposition(preemptions=1)])["engine/preemptions"] == 1  # counters went down
    assert scrape_of('http_requests_total{handler="/health"} 3\n') is None
    assert EngineMetrics().step_stats(['http_requests_total{handler="/health"} 3\n']) == {}


def test_readings_that_are_no_readings_are_left_out():
    """NaN KV usage, a negative queue, a huge label line: each left out, the rest read (before, NaN froze the cap)."""
    text = exposition(kv=0.5) + 'vllm:kv_cache_usage_perc{engine="1"} NaN\nvllm:num_requests_waiting{engine="1"} -3\n'
    text += "vllm:num_requests_running{" + "a" * 40_000 + '="x"} 5\n'
    scrape = scrape_of(text)
    assert scrape.gauges == {"kv_cache_usage": 0.5, "requests_running": 3, "requests_waiting": 1}


def test_a_metrics_read_has_a_deadline_and_a_size_bound_and_names_the_server(monkeypatch):
    """A server that drips its reply, one that answers 5 MiB, one that answers: the step gets the third's figures
    within the deadline, and the log names the other two once."""
    import asyncio
    import time

    from rl.orchestrator import inference_pool
    from rl.orchestrator.inference_pool import InferencePool

    monkeypatch.setattr(inference_pool, "METRICS_TIMEOUT_S", 1.0)

    async def serve(reader, writer):
        request = await reader.readuntil(b"\r\n\r\n")
        port = writer.get_extra_info("sockname")[1]
        kind = kinds[port]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        if kind == "drip":
            for byte in exposition().encode():
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)
        elif kind == "huge":
            writer.write(b"# " + b"x" * (5 << 20) + b"\n")
        else:
            writer.write(exposition(kv=0.7).encode())
        await writer.drain()
        writer.close()
        assert request

    async def scenario():
        servers = [await asyncio.start_server(serve, "127.0.0.1", 0) for _ in range(3)]
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        kinds.update(zip(ports, ("drip", "huge", "fine")))
        log = []
        pool = InferencePool([f"http://127.0.0.1:{p}" for p in ports], None, 30.0, log=log.append)
        start = time.monotonic()
        first = await pool.metrics()
        took = time.monotonic() - start
        await pool.metrics()  # the same trouble again: not logged again
        await pool.close()
        for s in servers:
            s.close()
        return first, took, log, ports

    kinds: dict[int, str] = {}
    scrapes, took, log, ports = asyncio.run(scenario())
    assert scrapes[0] is None and scrapes[1] is None and scrapes[2].gauges["kv_cache_usage"] == 0.7
    assert took < 3.0
    assert len(log) == 2  # in the order the reads ended
    assert any(f"127.0.0.1:{ports[0]}/metrics did not answer whole within 1 s" in line for line in log)
    assert any(f"127.0.0.1:{ports[1]}/metrics replied more than 4 MiB" in line for line in log)
