"""One RL step through `rl serve-api` (the Tinker SDK's forward_backward, optim_step, save_weights_for_sampler)
against the same work in rl's own loop (the trainer on a batch file, then its publish), same batch, same model,
LoRA of the same rank, one trainer rank.

- own: rl's trainer (`rl.trainer.main`) on batches written up front; its `step_time_s` per step (train and publish);
- api: `rl serve-api` and the SDK as a client; per step, the time from sending forward_backward to the sampler
  weights' save answered.

The first `--warmup` steps of each side are left out; the median of the rest is compared within each of `--rounds`
pairs of runs (their order alternated), and the median of the pairs' ratios is the result. The last line reads:

tinker api: <r>x the step time of rl's own loop (median of <n> rounds: <each>)

    uv run --no-sync python benchmarks/tinker_api.py --model /tmp/tiny [--steps 8] [--samples 32] [--dry-run]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
KEY = "tml-benchmark"
LAUNCHES = itertools.count()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs, their order alternated")
    parser.add_argument("--samples", type=int, default=32, help="samples per step")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per sample (a third prompt)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of both sides")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    return parser.parse_args()


def samples(args, vocab: int) -> list:
    from rl.samples import Sample

    rng = np.random.default_rng(0)
    prompt = args.tokens // 3
    made = []
    for i in range(args.samples):
        ids = rng.integers(0, vocab, size=args.tokens).tolist()
        mask = [0] * prompt + [1] * (args.tokens - prompt)
        logprobs = [0.0] * prompt + rng.uniform(-5, -0.1, size=args.tokens - prompt).tolist()
        made.append(Sample(ids, mask, logprobs, advantage=1.0 if i % 2 else -1.0, reward=0.0, policy_version=0))
    return made


def common_flags(args, out: Path) -> list[str]:
    configs = ROOT / "configs" / "reverse_text"
    return ["--trainer", "@", str(configs / "train.toml"), "--inference", "@", str(configs / "infer.toml"),
            "--model.name", str(args.model), "--output-dir", str(out), "--seq-len", str(args.tokens + 32),
            "--trainer-processes", "1", "--inference.kv-cache-gib", "0.25"]


def own_command(args, out: Path) -> list[str]:
    return [sys.executable, "-m", "rl.trainer.ranks", "--nproc-per-node=1", "--standalone", "-m", "rl.trainer.main",
            "@", str(out / "configs" / "trainer.toml")]


def run_own(args, out: Path, batch: list) -> list[float]:
    """The trainer's resolved config as `rl` writes it (dry run), with LoRA; every batch written before it starts."""
    from rl.config import parse_config, write_config
    from rl.protocol import RunPaths, read_metrics, write_batch
    from rl.trainer.config import TrainerConfig

    listed = subprocess.run([sys.executable, "-m", "rl.launcher.main", "--orchestrator", "@",
                             str(ROOT / "configs" / "reverse_text" / "orch.toml"), *common_flags(args, out),
                             "--max-steps", str(args.steps), "--dry-run"], capture_output=True, text=True, cwd=ROOT)
    section = listed.stdout.split("# ---- trainer config ----\n")[1].split("# ----")[0]
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "configs" / "trainer.given.toml").write_text(section)
    config = parse_config(TrainerConfig, ["@", str(out / "configs" / "trainer.given.toml"), "--lora.rank",
                                          str(args.rank), "--lora.publish-merged", "true"])
    write_config(config, out / "configs" / "trainer.toml")
    paths = RunPaths(out)
    for step in range(args.steps):
        write_batch(paths, step, [batch])
    from rl.launcher.main import cpu_trainer_env
    from rl.launcher.devices import cpu_plan

    env = os.environ | cpu_trainer_env(cpu_plan(1, 1))  # as `rl` starts its trainer (and serve-api's) here
    with open(out / "own.log", "w") as log:
        subprocess.run(own_command(args, out), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=True,
                       timeout=1800, env=env)
    return [m["step_time_s"] for m in read_metrics(paths) if m.get("process") == "trainer"]


def datums(batch: list) -> list:
    import tinker

    return [tinker.Datum(model_input=tinker.ModelInput.from_ints(s.input_ids[:-1]), loss_fn_inputs={
        "target_tokens": s.input_ids[1:], "logprobs": s.logprobs[1:],
        "advantages": [s.advantage * m for m in s.loss_mask[1:]]}) for s in batch]


def run_api(args, out: Path, batch: list) -> list[float]:
    import tinker

    port = 18000 + (os.getpid() % 200) * 10 + 2 * next(LAUNCHES)  # a fresh pair each run: none left bound
    command = [sys.executable, "-m", "rl.launcher.main", "serve-api", *common_flags(args, out), "--api.port",
               str(port), "--inference.port", str(port + 1)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:  # beside its run directory, which rl makes
        launched = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=os.environ | {"TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"})
    service = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, launched)
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        trainer = service.create_lora_training_client(base_model=str(args.model), rank=args.rank)
        data, times = datums(batch), []
        for step in range(args.steps):
            start = time.perf_counter()  # the three sent at once, as the cookbook's loops send them
            futures = [trainer.forward_backward(data, "ppo"), trainer.optim_step(tinker.AdamParams(learning_rate=1e-4)),
                       trainer.save_weights_for_sampler(f"step-{step}")]
            for future in futures:
                future.result()
            times.append(time.perf_counter() - start)
        return times
    finally:
        if service is not None:
            service.close("success").result()  # else its session's heartbeat outlives the server, failing every 10 s
        launched.terminate()
        launched.wait(60)


def wait_up(url: str, launched: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launched.poll() is None:
        try:
            if httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"rl serve-api did not answer at {url} within {timeout_s:.0f} s (or exited)")


def main() -> None:
    args = parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="tinker-api-"))
    if args.dry_run:
        print("own:", shlex.join(own_command(args, out / "own")))
        print("api:", shlex.join([sys.executable, "-m", "rl.launcher.main", "serve-api", *common_flags(args, out)]))
        return
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    batch = samples(args, vocab)
    ratios = []
    for round in range(args.rounds):  # the machine's noise moves both sides alike only within a pair
        sides = [("own", run_own), ("api", run_api)]
        medians = {}
        for name, run in sides if round % 2 == 0 else sides[::-1]:
            where = out / f"round_{round}" / name
            times = run(args, where, batch)[args.warmup:]
            medians[name] = statistics.median(times)
            print(f"round {round} {name}: median {medians[name]:.3f} s per step over {len(times)} steps ({where})")
        ratios.append(medians["api"] / medians["own"])
        print(f"round {round}: {ratios[-1]:.2f}x")
    print(f"tinker api: {statistics.median(ratios):.2f}x the step time of rl's own loop (median of {args.rounds} "
          f"rounds: {', '.join(f'{r:.2f}' for r in ratios)})")

if __name__ == "__main__":
    main()
