"""A real vLLM server's /metrics, read as the orchestrator reads them: with a KV cache of ~19 blocks and more requests
than fit, the step record's engine figures and the adaptive cap see the cache fill and the server preempt."""

import asyncio
from pathlib import Path

import httpx
import pytest

from rl.orchestrator.concurrency import ConcurrencyController
from rl.orchestrator.config import ConcurrencyConfig
from rl.orchestrator.engine_metrics import EngineMetrics
from tests.integration.inference_server import Server

pytestmark = pytest.mark.integration
REQUESTS, PROMPT, COMPLETION = 32, 40, 200  # 32 x 240 tokens against a cache of ~2,500 (5 MiB at 2 KiB a token)


async def load_and_read(server: Server, model: Path, controller: ConcurrencyController) -> tuple[list, list[str]]:
    """Send the requests at once and read /metrics every 0.5 s until they end: the controller's decisions, and
    the texts read."""
    decisions, texts = [], []
    async with httpx.AsyncClient(timeout=300) as http:
        async def one(i: int) -> None:
            body = {"model": str(model), "token_ids": [5 + i] * PROMPT,
                    "sampling_params": {"max_tokens": COMPLETION, "ignore_eos": True, "seed": i}}
            (await http.post(f"{server.url}/inference/v1/generate", json=body)).raise_for_status()

        jobs = asyncio.gather(*(one(i) for i in range(REQUESTS)))
        while not jobs.done():
            await asyncio.sleep(0.5)
            texts.append((await http.get(f"{server.url}/metrics")).text)
            # judged as if the groups in flight had drained to the cap: each reading's own signal decides
            decisions.append(controller.update(texts[-1:], in_flight=controller.cap))
        await jobs
        texts.append((await http.get(f"{server.url}/metrics")).text)
        decisions.append(controller.update(texts[-1:], in_flight=controller.cap))  # every preemption read
    return decisions, texts


def test_a_real_servers_metrics_show_the_cache_filling_and_preemptions_and_the_cap_is_cut(tiny_model, tmp_path):
    server = Server(tiny_model, tmp_path / "weights", tmp_path / "server.log", toml="log_stats = true\n",
                    max_model_len=256, kv_cache_gib=0.005)
    try:
        before = httpx.get(f"{server.url}/metrics").text
        engine = EngineMetrics()
        engine.step_stats([before])  # the step before: counters from here
        controller = ConcurrencyController(ConcurrencyConfig(adaptive=True, min_rollouts=4), REQUESTS, 4)
        controller.update([before], in_flight=0)  # its counters from here too, so no preemption goes unread
        decisions, texts = asyncio.run(load_and_read(server, tiny_model, controller))
    finally:
        server.stop()
    loads = [controller.load([text]) for text in texts]
    assert all(load is not None for load in loads)  # every reading held vLLM's statistics
    assert max(load.kv_usage for load in loads) >= 0.9, [load.kv_usage for load in loads]
    stats = engine.step_stats([texts[-1]])
    assert stats["engine/preemptions"] > 0 and stats["engine/0/preemptions"] == stats["engine/preemptions"]
    assert stats["engine/ttft_p50_s"] <= stats["engine/ttft_p90_s"] and stats["engine/latency_p90_s"] > 0
    assert stats["engine/requests_running"] == 0  # all ended
    whys = [d.why for d in decisions]
    assert "cut" in whys, whys  # a preemption cut the cap
    assert "drain" not in whys and min(d.cap for d in decisions) >= 4 and decisions[-1].cap < REQUESTS
