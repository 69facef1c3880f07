"""SFT warm-up (run under torchrun): cross-entropy on the completion tokens of examples made from an
environment's tasks, then the model is written in Hugging Face layout for RL to start from.

    L = - sum_t mask_t * log pi_theta(x_t | x_<t) / sum_t mask_t      (mask: completion tokens only)

Each task gives one example: its prompt rendered with the chat template (generation prompt added) and
the task's reference answer (`answer_field` of the task data) followed by the end-of-turn token.

    uv run torchrun --nproc-per-node 2 -m rl.trainer.sft @ configs/reverse_text/sft.toml
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict
from transformers import AutoTokenizer

from rl.config import ModelConfig, Settings, run_cli
from rl.envs.config import EnvConfig
from rl.metrics import setup_logging
from rl.samples import Sample
from rl.trainer.data import build_micro_batches, empty_micro_batch, filler_token_id, trained_tokens, truncate
from rl.trainer.model import forward_logprobs, load_model, prepare_for_training
from rl.trainer.config import OptimConfig
from rl.trainer.optim import build_optimizer, build_scheduler, clip_gradients
from rl.trainer.weights import DEFAULT_SHARD_BYTES, hf_side_files, save_model_dir
from rl.trainer.world import World, init_world


class SFTConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_SFT__")

    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig(id="reverse-text")
    answer_field: Annotated[str, Field(description="task data field holding the reference answer")] = "answer"
    output_dir: Annotated[Path, Field(description="directory the fine-tuned model is written to (HF layout)")] = Path(
        "models/sft"
    )
    max_steps: Annotated[int, Field(ge=1, description="optimizer steps")] = 200
    batch_size: Annotated[int, Field(ge=1, description="examples per optimizer step (all ranks)")] = 64
    micro_batch_size: Annotated[int, Field(ge=1, description="examples per forward/backward pass")] = 64
    seq_len: Annotated[int, Field(ge=16, description="examples longer than this are truncated")] = 256
    optim: OptimConfig = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=10)
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16"],
        Field(description="compute dtype, as the trainer's: bfloat16 (GPU only) with fp32 master weights; auto: "
                          "bfloat16 on CUDA, float32 on CPU"),
    ] = "auto"
    log_interval: Annotated[int, Field(ge=1, description="log every N steps")] = 10
    seed: Annotated[int, Field(description="seed of the example order")] = 0

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        """Names of earlier versions, refused naming the trainer's words that replaced them."""
        renamed = {"out": "output_dir", "steps": "max_steps", "lr": "optim.lr", "warmup_steps": "optim.warmup_steps",
                   "max_grad_norm": "optim.max_grad_norm"}
        old = [name for name in renamed if isinstance(data, dict) and name in data]
        if old:
            raise ValueError("; ".join(f"{name} is now {renamed[name]}" for name in old) + " (the trainer's names)")
        return data


def build_examples(config: SFTConfig, tokenizer) -> list[Sample]:
    """One prompt + answer example per task of the environment."""
    from rl.envs.loading import load_environment

    env = load_environment(config.env)
    examples = []
    for task in env.tasks:
        answer = getattr(task.data, config.answer_field, None)
        if not isinstance(answer, str):
            raise ValueError(
                f"environment {config.env.id!r} tasks have no string field {config.answer_field!r} to train on; "
                "set answer_field"
            )
        prompt = prompt_messages(task.data)
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        completion = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = list(prompt_ids) + completion
        mask = [0] * len(prompt_ids) + [1] * len(completion)
        examples.append(Sample(ids, mask, [0.0] * len(ids), 0.0, 0.0, 0))
    return examples


def prompt_messages(data) -> list[dict]:
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in data.prompt]


def sft_step(model, optimizer, batch: list[Sample], config: SFTConfig, world: World, pad_id: int) -> float:
    local = [truncate(s, config.seq_len) for s in batch[world.rank :: world.world_size]]
    total_tokens, = world.all_reduce([sum(trained_tokens(s) for s in local)])
    weights = [1.0] * len(local)
    mbs = build_micro_batches(local, weights, config.seq_len, config.micro_batch_size, packing=False, pad_id=pad_id)
    count, = world.all_reduce([len(mbs)], op="max")  # every rank runs the same passes
    mbs += [empty_micro_batch(pad_id, packing=False)] * (int(count) - len(mbs))
    loss_sum = 0.0
    for mb in mbs:
        mb = mb.to(world.device)
        logprobs, _ = forward_logprobs(model, mb)  # [B, T]
        token_loss = -(logprobs * mb.loss_mask).sum()
        (token_loss * world.world_size / max(total_tokens, 1)).backward()
        loss_sum += token_loss.item()
    clip_gradients(model, config.optim.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss, = world.all_reduce([loss_sum])
    return loss / max(total_tokens, 1)


def main() -> None:
    config = run_cli(SFTConfig)
    logger = setup_logging("sft")
    world = init_world()
    torch.manual_seed(config.seed)
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if world.device.type == "cuda" else "float32")
    model = prepare_for_training(load_model(config.model.name, dtype, world), activation_checkpointing=False)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    examples = build_examples(config, tokenizer)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.max_steps)
    order = random.Random(config.seed)
    if world.is_main:
        logger.info(f"SFT on {len(examples)} examples of {config.env.id} for {config.max_steps} steps")
    start, history = time.perf_counter(), []
    for step in range(config.max_steps):
        lr = scheduler.get_last_lr()[0]
        batch = order.sample(examples, min(config.batch_size, len(examples)))
        loss = sft_step(model, optimizer, batch, config, world, filler_token_id(tokenizer))
        scheduler.step()
        history.append(loss)
        if world.is_main and (step % config.log_interval == 0 or step == config.max_steps - 1):
            logger.info(f"step {step} | loss={loss:.4f} lr={lr:.3g} time={time.perf_counter() - start:.1f}s")
    side_files = hf_side_files(model.config, tokenizer) if world.is_main else {}
    save_model_dir(model, config.output_dir, side_files, world, torch.float32, DEFAULT_SHARD_BYTES)
    if world.is_main:
        (config.output_dir / "sft_history.json").write_text(json.dumps({"loss": history}) + "\n")
        logger.info(f"wrote {config.output_dir}")
    world.close()


if __name__ == "__main__":
    main()
