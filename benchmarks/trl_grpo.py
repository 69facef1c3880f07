"""TRL's GRPOTrainer on the side-by-side task; run by trl_side_by_side.py with TRL's own interpreter.

It imports nothing from rl (TRL lives in its own virtual environment): the prompts and answers come
as JSON lines, the reward is the same LCS ratio as the reverse-text environment, and the result is one
JSON object of step end times and generation times.

    .venv-trl/bin/python benchmarks/trl_grpo.py --model M --data tasks.jsonl --out trl.json [--vllm]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="JSON lines with prompt and answer")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True, help="completions per optimizer step")
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, default=32, help="completions per forward/backward")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--vllm", action="store_true", help="generate with vLLM in colocate mode")
    return parser.parse_args()


def lcs_ratio(a: str, b: str) -> float:
    """2 * LCS(a, b) / (len(a) + len(b)): the reverse-text environment's reward."""
    if not a and not b:
        return 1.0
    previous = [0] * (len(b) + 1)
    for char in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if char == other else max(previous[j + 1], current[j]))
        previous = current
    return 2 * previous[-1] / (len(a) + len(b))


def reward(completions, answer, **_) -> list[float]:
    return [lcs_ratio(c[-1]["content"].strip(), a) for c, a in zip(completions, answer)]


def main() -> None:
    args = parse_args()
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])
    micro = min(args.micro_batch, args.batch_size)
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-output"),
        max_steps=args.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.batch_size // micro,  # one generation of batch_size per step
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        learning_rate=args.lr,
        temperature=1.0,
        beta=0.0,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        use_vllm=args.vllm,
        vllm_mode="colocate",
    )

    step_ends: list[float] = []
    generation_s: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=dataset,
                          callbacks=[StepTimes()])
    generate = trainer._generate  # the rollout half of a step, timed to split generation from training

    def timed_generate(*a, **k):
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generation_s.append(time.perf_counter() - start)

    trainer._generate = timed_generate
    start = time.perf_counter()
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    Path(args.out).write_text(json.dumps({
        "start": start, "step_ends": step_ends, "generation_s": generation_s, "rewards": rewards,
        "completion_len": lengths, "mode": "vllm-colocate" if args.vllm else "default",
    }))


if __name__ == "__main__":
    main()
