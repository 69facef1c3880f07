"""Router replay on a mixture of experts: how often the trainer routes tokens where inference did, and the
train-inference mismatch, with and without replay, from one start.

The tiny Qwen3-MoE (`tiny-model --arch qwen3_moe`) is served in bfloat16 (vLLM's CPU MoE kernels) while the trainer
computes in float32 (rl's trainer computes in bf16 on GPUs only): the two routers see slightly different hidden
states, and a near tie between two experts flips. The runs start from a copy of the model whose weights are rounded to
bfloat16 (kept in float32), so that both sides start from the same weights and the mismatch is the computation's.
Two sides run the quickstart's task on-policy (async level 0), the same seed and `--steps`, their order alternated
over `--rounds`:

- replay: `--trainer.loss.router-replay true` (the default): every token goes to the experts inference recorded;
- no-replay: `--trainer.loss.router-replay false --inference.router-replay true`: the trainer's router chooses;
  inference's record is only compared with that choice.

Per run, from the trainer's records (means over the steps): `moe/routed_as_recorded`, the share of recorded
(token, layer) pairs the trainer sent to the experts inference used, `moe/router_agreement`, the share its own
router chose as inference did, and `mismatch_kl`, the train-inference KL of the trained tokens' logprobs. The last
line reads (medians over rounds):

router replay: experts agree <a>% -> <r>%, mismatch_kl <b> -> <c>

    uv run --no-sync tiny-model --arch qwen3_moe --out /tmp/tiny-moe
    uv run --no-sync python benchmarks/router_replay.py --model /tmp/tiny-moe [--steps 6] [--rounds 2] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "reverse_text"
# inference.router_replay follows the trainer's unless set: the no-replay side keeps the record to compare against
SIDES = {"no-replay": ["--trainer.loss.router-replay", "false", "--inference.router-replay", "true"],
         "replay": ["--trainer.loss.router-replay", "true"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the tiny MoE (`tiny-model --arch qwen3_moe`)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, their order alternated")
    parser.add_argument("--dtype", default="bfloat16", help="what inference serves (the trainer computes in fp32)")
    parser.add_argument("--out", type=Path, help="runs' directory (default: a new temporary one)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="print each side's command line and run nothing")
    return parser.parse_args()


def quickstart_command(model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """The quickstart's `rl` run from `model` for `steps` steps into `out`, `extra` (a side's flags) beside it; the
    benchmarks on the quickstart's task share it."""
    return [sys.executable, "-m", "rl.launcher.main",
            "--trainer", "@", str(CONFIGS / "train.toml"), "--orchestrator", "@", str(CONFIGS / "orch.toml"),
            "--inference", "@", str(CONFIGS / "infer.toml"), "--model.name", str(model),
            "--max-steps", str(steps), "--seq-len", "128", "--output-dir", str(out), *extra]


def rl_command(model: Path, out: Path, args, *extra: str) -> list[str]:
    """The quickstart's run from `model`, on-policy, served in `args.dtype`, `extra` (a side's flags) beside it."""
    return quickstart_command(model, out, args.steps, "--async-level", "0", "--inference.dtype", args.dtype, *extra)


def run(model: Path, out: Path, args, *extra: str) -> list[dict]:
    """The run's trainer records, by step."""
    print("+", out.name, *extra, flush=True)
    with out.with_suffix(".log").open("w") as log:
        done = subprocess.run(rl_command(model, out, args, *extra), stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{out.name} exited {done.returncode}; see {out.with_suffix('.log')}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in records if r["process"] == "trainer"), key=lambda r: r["step"])


def measure(steps: list[dict]) -> dict:
    """Means over the run's steps of the routing shares and the mismatch KL; an error where a step has no record
    of inference's routing (the model is no MoE, or inference recorded nothing)."""
    if not steps or any("moe/routed_as_recorded" not in r for r in steps):
        raise RuntimeError("a trainer step without moe/routed_as_recorded: is --model a mixture of experts, served "
                           "with inference.router_replay on?")
    return {key: statistics.fmean(r[key] for r in steps)
            for key in ("moe/routed_as_recorded", "moe/router_agreement", "mismatch_kl")}


def rounded_copy(model: Path, out: Path, dtype: str) -> Path:
    """`model` with every weight rounded to `dtype` and stored as before (float32): the weights inference serves."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out, dirs_exist_ok=True)
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({k: v.to(getattr(torch, dtype)).to(v.dtype) for k, v in tensors.items()}, str(file),
                  metadata={"format": "pt"})
    return out


def main() -> None:
    args = parse_args()
    if args.dry_run:
        root = args.out or Path(tempfile.gettempdir()) / "rl-router-replay-XXXX"
        for side, flags in SIDES.items():
            print(f"{side}: {shlex.join(rl_command(args.model, root / f'{side}-0', args, *flags))}")
        return
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-router-replay-"))
    root.mkdir(parents=True, exist_ok=True)
    model = rounded_copy(args.model, root / f"model-{args.dtype}", args.dtype)
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side in list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]:
            result = measure(run(model, root / f"{side}-{round_}", args, *SIDES[side]))
            results[side].append(result)
            print(f"round {round_ + 1} {side}: routed as recorded {100 * result['moe/routed_as_recorded']:.2f}%, "
                  f"router agrees {100 * result['moe/router_agreement']:.2f}%, mismatch_kl "
                  f"{result['mismatch_kl']:.3g}", flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    median = {side: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for side, runs in results.items()}
    before, after = median["no-replay"], median["replay"]
    print(f"router replay: experts agree {100 * before['moe/routed_as_recorded']:.1f}% -> "
          f"{100 * after['moe/routed_as_recorded']:.1f}%, mismatch_kl {before['mismatch_kl']:.3g} -> "
          f"{after['mismatch_kl']:.3g}")


if __name__ == "__main__":
    main()
