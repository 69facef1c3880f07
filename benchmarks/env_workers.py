"""Rollouts/s of an environment whose scoring burns CPU, served by rl's env server with 2 workers against 1.

The environment (`tests/fixtures/environments/cpu_score`) spins for `--score-ms` (50) of CPU in each rollout's
reward, on its worker's event loop, as parsers, code execution and judges do. One tiny-model inference server is
shared by both sides; each round starts an env server (`rl.envs.server`) with 1 or 2 workers, waits for it, warms
it with a few rollouts, then times `--rollouts` (64) rollouts, all sent at once through verifiers' `EnvClient`.
Rounds alternate 1, 2, 2, 1, ... (the machine is noisy); the last line is the ratio of the medians:

    env workers 2 vs 1: <X>x rollouts/s

    uv run python benchmarks/env_workers.py [--rounds 2] [--rollouts 64] [--score-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import verifiers.v1 as vf  # noqa: E402
from verifiers.v1.serve import EnvClient  # noqa: E402

from rl.config import API_KEY_VAR  # noqa: E402
from rl.renderer import renderer_config  # noqa: E402
from rl.tiny_model import build_tiny_model  # noqa: E402
from tests.integration.inference_server import Server, stop_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "environments"
WARM_ROLLOUTS = 4


def tasks_data(score_ms: float) -> list[dict]:
    """What the orchestrator would ship for each task of cpu-score (its TaskData, dumped)."""
    sys.path.insert(0, str(FIXTURES))
    from cpu_score import CpuScoreConfig, CpuScoreTaskset

    return [task.data.model_dump() for task in CpuScoreTaskset(CpuScoreConfig(num_examples=256, score_ms=score_ms))]


async def rollouts_per_s(address: str, server: Server, rollouts: int, tasks: list[dict]) -> float:
    renderer = renderer_config("auto", str(server.model))[0]
    # rl's inference key's variable, as the orchestrator's client names it: the one an env server lets a request read
    client_config = vf.TrainClientConfig(base_url=f"{server.url}/v1", renderer=renderer, api_key_var=API_KEY_VAR,
                                         renderer_model_name=str(server.model))
    sampling = vf.SamplingConfig(temperature=1.0, max_tokens=8)
    client = EnvClient(address)
    try:
        await client.wait_for_server_startup(timeout=300)

        async def run(i: int):
            episode = await client.run(client_config, str(server.model), sampling, tasks[i % len(tasks)])
            if not episode.ok:
                raise RuntimeError(f"rollout {i} failed: {episode.last_error}")

        await asyncio.gather(*(run(i) for i in range(WARM_ROLLOUTS * 2)))  # every worker loaded and warm
        start = time.perf_counter()
        await asyncio.gather(*(run(i) for i in range(rollouts)))
        return rollouts / (time.perf_counter() - start)
    finally:
        await client.close()


def measure(root: Path, server: Server, workers: int, rollouts: int, score_ms: float, round_: int,
            tasks: list[dict]) -> float:
    address = f"ipc://{root}/cpu-score-{round_}.sock"
    log = root / f"env-server-{round_}-{workers}.log"
    args = json.dumps({"num_examples": 256, "score_ms": score_ms})
    process = subprocess.Popen(
        [sys.executable, "-m", "rl.envs.server", "--env.id", "cpu-score", "--env.args", args,
         "--workers", str(workers), "--address", address],
        cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        env=os.environ | {"PYTHONPATH": str(FIXTURES)})
    try:
        return asyncio.run(rollouts_per_s(address, server, rollouts, tasks))
    except Exception:
        print(log.read_text()[-3000:])
        raise
    finally:
        stop_process(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each side")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--score-ms", type=float, default=50.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_tiny_model(root / "model")
        server = Server(root / "model", root, root / "inference.log")
        rates: dict[int, list[float]] = {1: [], 2: []}
        tasks = tasks_data(args.score_ms)
        try:
            order = [w for r in range(args.rounds) for w in ((1, 2) if r % 2 == 0 else (2, 1))]
            for i, workers in enumerate(order):
                rate = measure(root, server, workers, args.rollouts, args.score_ms, i, tasks)
                rates[workers].append(rate)
                print(f"round {i}: {workers} worker(s): {rate:.1f} rollouts/s")
        finally:
            server.stop()
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"{args.rollouts} rollouts of cpu-score ({args.score_ms:g} ms of CPU each), median rollouts/s: "
          f"1 worker {one:.1f}, 2 workers {two:.1f}")
    print(f"env workers 2 vs 1: {two / one:.2f}x rollouts/s")


if __name__ == "__main__":
    main()
