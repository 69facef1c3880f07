"""On-policy distillation against RL alone, from the quickstart's SFT model: steps to halve the reward gap to a teacher.

The teacher is the SFT model after a longer RL run (`--teacher-steps`, the quickstart's settings): a model of
clearly higher reward with the student's tokenizer. Then, from the SFT model, rounds of two runs of `--steps` each,
their order alternated: distillation as the README recommends it (`--teacher.model <teacher> --teacher.top-k 8
--trainer.loss.distill-top-k 1 --trainer.loss.distill 0 --trainer.optim.lr 3e-3`: the dense term beside the reward,
at its own learning rate) and RL alone (the quickstart's run).

The gap is the teacher's reward (the mean over its run's last 5 steps) minus the SFT model's: the mean over every
run (the teacher's too) of the steps sampled from the SFT weights, before any update reached inference (the first
ASYNC_LEVEL + 1 steps). One start for all: a run's own first steps would include its first updates, and a side
whose first updates cost reward would get a lower target. A run halves the gap at the first step where the mean
of 5 consecutive steps' rewards reaches the start plus half the gap. Each side's figure is the median over rounds.
Also printed: each run's lowest 5-step mean (the cost of its first updates) and `distill/reverse_kl` at the start
and end of each distillation run. The last line reads
`distill <D> steps, rl <R> steps to halve the gap to the teacher` (">N" where a run did not within its N steps).
`--distill` and `--reward-weight` set the distillation side's loss, `--distill-lr` and `--distill-warmup` its learning
rate and warm-up; `--top-k K`
adds the dense term over the teacher's K likeliest tokens (`--teacher.top-k K --trainer.loss.distill-top-k W`, W from
`--distill-top-k`); `--sides distill` runs that side alone.

    uv run python benchmarks/distill.py                       # ~30 min on 2 cores
    uv run python benchmarks/distill.py --rounds 1 --steps 40 --out /tmp/distill
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rl.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "reverse_text"
WINDOW = 5
ASYNC_LEVEL = 1  # every run's --async-level: steps 0..ASYNC_LEVEL sample from the weights the run starts from


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="steps of each compared run")
    parser.add_argument("--teacher-steps", type=int, default=120, help="RL steps that make the teacher")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--distill", type=float, default=0.0, help="the distillation side's trainer.loss.distill")
    parser.add_argument("--reward-weight", type=float, default=1.0,
                        help="the distillation side's trainer.loss.reward_weight (0: the teacher's signal only)")
    parser.add_argument("--distill-lr", type=float, default=3e-3,
                        help="the distillation side's trainer.optim.lr (RL's is the quickstart's, 1e-3)")
    parser.add_argument("--top-k", type=int, default=8, help="the teacher's top-k for the dense term (0: off)")
    parser.add_argument("--distill-top-k", type=float, default=1.0,
                        help="the distillation side's trainer.loss.distill_top_k, with --top-k")
    parser.add_argument("--distill-warmup", type=int, help="the distillation side's trainer.optim.warmup_steps "
                                                             "(default: the quickstart's, as RL's)")
    parser.add_argument("--sides", default="distill,rl", help="which sides run (comma-separated)")
    parser.add_argument("--out", type=Path, help="keep everything here (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=3600, help="deadline in seconds for each run")
    return parser.parse_args()


def run(command: list[str], log: Path, timeout: float) -> None:
    print("+", " ".join(command[:6]), "...", flush=True)
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"exited {done.returncode}; see {log}")


def sft_command(model: Path, out: Path) -> list[str]:
    """The quickstart's SFT of `model` into `out`, on 2 ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "rl.trainer.sft", "@", str(CONFIGS / "sft.toml"), "--model.name", str(model),
            "--output-dir", str(out)]


def sft(model: Path, out: Path, timeout: float) -> Path:
    run(sft_command(model, out), out.parent / f"{out.name}.log", timeout)
    return out


def rl(model: Path, out: Path, steps: int, timeout: float, *extra: str) -> list[dict]:
    """The quickstart's RL run; returns its orchestrator and trainer records by step. A run already finished in
    `out` (an interrupted benchmark's) is read, not run again."""
    if not (out / "summary.json").exists():
        start_run(model, out, steps, timeout, *extra)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if len(rewards(records)) != steps:
        raise RuntimeError(f"{out} holds a run of {len(rewards(records))} steps, not {steps}: move it away")
    return records


def rl_command(model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """The quickstart's RL run from `model`, `extra` (a side's flags) beside it."""
    return [sys.executable, "-m", "rl.launcher.main",
            "--trainer", "@", str(CONFIGS / "train.toml"), "--orchestrator", "@", str(CONFIGS / "orch.toml"),
            "--inference", "@", str(CONFIGS / "infer.toml"), "--model.name", str(model), "--max-steps", str(steps),
            "--seq-len", "128", "--async-level", str(ASYNC_LEVEL), "--output-dir", str(out), *extra]


def start_run(model: Path, out: Path, steps: int, timeout: float, *extra: str) -> None:
    run(rl_command(model, out, steps, *extra), out.parent / f"{out.name}.log", timeout)


def rewards(records: list[dict]) -> list[float]:
    return [r["reward"] for r in sorted(records, key=lambda r: r["step"]) if r["process"] == "orchestrator"]


def steps_to_halve(curve: list[float], start: float, teacher: float) -> int | None:
    """The first step (1-based count) whose window of WINDOW steps ending there averages start + gap / 2."""
    target = start + (teacher - start) / 2
    for end in range(WINDOW, len(curve) + 1):
        if statistics.fmean(curve[end - WINDOW:end]) >= target:
            return end
    return None


def shown(steps: list[int | None], limit: int) -> str:
    known = [s if s is not None else limit + 1 for s in steps]
    median = statistics.median(known)
    return f">{limit}" if median > limit else f"{median:g}"


def side_flags(args: argparse.Namespace, teacher: Path) -> dict[str, list[str]]:
    """The flags of each side that runs (`--sides`) beside the quickstart's: distillation from `teacher`, RL alone."""
    distill = ["--teacher.model", str(teacher), "--trainer.loss.distill", str(args.distill),
               "--trainer.loss.reward-weight", str(args.reward_weight)]
    distill += ["--trainer.optim.lr", str(args.distill_lr)] if args.distill_lr else []
    distill += ["--trainer.optim.warmup-steps", str(args.distill_warmup)] if args.distill_warmup is not None else []
    distill += ["--teacher.top-k", str(args.top_k), "--trainer.loss.distill-top-k", str(args.distill_top_k)] \
        if args.top_k else []
    return {side: flags for side, flags in (("distill", distill), ("rl", [])) if side in args.sides.split(",")}


def main() -> None:
    args = parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-distill-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"runs in {root}", flush=True)
    student = root / "model-sft"
    if not (student / "config.json").exists():
        sft(build_tiny_model(root / "model-tiny"), student, args.timeout)
    teacher_run = root / "teacher-run"
    teacher_curve = rewards(rl(student, teacher_run, args.teacher_steps, args.timeout))
    teacher_reward = statistics.fmean(teacher_curve[-WINDOW:])
    teacher = teacher_run / "weights" / f"step_{args.teacher_steps}"
    print(f"teacher: {teacher} (reward {teacher_reward:.3f} over its last {WINDOW} steps; "
          f"first {ASYNC_LEVEL + 1} steps {statistics.fmean(teacher_curve[:ASYNC_LEVEL + 1]):.3f})", flush=True)

    sides = side_flags(args, teacher)
    lr = f"-lr{args.distill_lr:g}" if args.distill_lr else ""
    lr += f"-warmup{args.distill_warmup}" if args.distill_warmup is not None else ""
    top_k = f"-top{args.top_k}x{args.distill_top_k:g}" if args.top_k else ""
    tag = {"distill": f"distill{args.distill:g}-rw{args.reward_weight:g}{lr}{top_k}", "rl": "rl"}
    curves: dict[str, list[list[float]]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
            records = rl(student, root / f"{tag[side]}-{round_}", args.steps, args.timeout, *sides[side])
            curves[side].append(rewards(records))
            print(f"round {round_ + 1} {side}: {describe(records)}", flush=True)
    runs = [curve for side_curves in curves.values() for curve in side_curves] + [teacher_curve]
    start = statistics.fmean(reward for curve in runs for reward in curve[:ASYNC_LEVEL + 1])
    print(f"start (the SFT weights' reward over {len(runs)} runs' first {ASYNC_LEVEL + 1} steps): {start:.3f}; "
          f"the target: {start + (teacher_reward - start) / 2:.3f}")
    halved = {side: [steps_to_halve(curve, start, teacher_reward) for curve in side_curves]
              for side, side_curves in curves.items()}
    for side, steps in halved.items():
        print(f"{side}: gap halved at steps {', '.join(str(s or f'>{args.steps}') for s in steps)}")
    (root / "results.json").write_text(json.dumps({"teacher_reward": teacher_reward, "start": start,
                                                   "halved": halved}, indent=1))
    if args.rounds:
        print(", ".join(f"{side} {shown(steps, args.steps)} steps" for side, steps in halved.items())
              + " to halve the gap to the teacher")


def describe(records: list[dict]) -> str:
    """A run's reward at its start and end, and its distillation terms' fall where it has them."""
    curve = rewards(records)
    lowest = min(statistics.fmean(curve[i:i + WINDOW]) for i in range(len(curve) - WINDOW + 1))
    text = (f"first {ASYNC_LEVEL + 1} steps {statistics.fmean(curve[:ASYNC_LEVEL + 1]):.3f}, "
            f"lowest {WINDOW}-step mean {lowest:.3f}, "
            f"last {WINDOW} steps {statistics.fmean(curve[-WINDOW:]):.3f}")
    trainer = [r for r in sorted(records, key=lambda r: r["step"]) if r["process"] == "trainer"]
    for key, name in (("distill/reverse_kl", "reverse KL"), ("distill/top_k_kl", "top-k KL")):
        values = [r[key] for r in trainer if key in r]
        if values:
            text += f"; {name} {statistics.fmean(values[:3]):.3f} -> {statistics.fmean(values[-3:]):.3f}"
    return text

if __name__ == "__main__":
    main()
