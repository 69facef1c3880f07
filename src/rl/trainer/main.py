"""Trainer entrypoint (run under torchrun): wait for batch -> forward/backward -> optimizer step ->
publish weights -> log, once per step."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.metrics import MetricsLogger, setup_logging
from rl.protocol import RunPaths, Sample, read_batch, wait_for_stable
from rl.trainer.checkpoint import Checkpointer
from rl.trainer.config import TrainerConfig
from rl.trainer.data import MicroBatch, micro_batches, pad_micro_batch
from rl.trainer.loss import policy_loss
from rl.trainer.weights import gather_full_state_dict, publish_weights
from rl.trainer.world import World, init_world
from rl.config import run_cli

LINE_KEYS = ("loss", "reward", "entropy", "clip_frac", "mismatch_kl", "grad_norm", "tokens_per_s", "step_time_s")


def load_model(config: TrainerConfig, world: World):
    dtype = getattr(torch, config.dtype)
    model = AutoModelForCausalLM.from_pretrained(config.model.name, dtype=dtype).to(world.device)
    for block in model.model.layers:
        fully_shard(block, mesh=world.mesh)
    fully_shard(model, mesh=world.mesh)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    return model, tokenizer


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each token given its prefix; position 0 (no prefix) gets 0."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T-1]
    pad = torch.zeros_like(picked[:, :1])
    return torch.cat([pad, picked], 1), torch.cat([pad, entropy], 1)  # [B, T] each


def all_reduce(values: list[float], world: World, op=dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def dummy_micro_batch(pad_id: int) -> MicroBatch:
    """A micro-batch with nothing to train on, for ranks with fewer micro-batches than their peers."""
    return pad_micro_batch([Sample([pad_id, pad_id], [0, 0], [0.0, 0.0], 0.0, 0.0, 0)], 2, pad_id)


def train_step(model, optimizer, samples: list[Sample], config: TrainerConfig, world: World, pad_id: int) -> dict:
    local_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
    local_micro = math.ceil(len(samples) / config.micro_batch_size)
    total_tokens, = all_reduce([local_tokens], world)
    num_micro, = all_reduce([local_micro], world, dist.ReduceOp.MAX)
    sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped, mismatch kl, entropy (token sums)
    for mb in micro_batches(samples, config.micro_batch_size, config.seq_len, pad_id, int(num_micro)):
        mb = (mb or dummy_micro_batch(pad_id)).to(world.device)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # [B, T, V]
        logprobs, entropy = token_logprobs(logits, mb.input_ids)
        loss, stats = policy_loss(
            logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask,
            config.loss.eps_low, config.loss.eps_high, int(total_tokens),
        )
        # FSDP averages gradients over ranks; the loss is already normalised by the global token count.
        (loss * world.world_size).backward()
        mask = mb.loss_mask.float()
        sums += torch.tensor(
            [stats.loss_sum, stats.clipped_tokens, stats.mismatch_kl_sum, (entropy.detach() * mask).sum()],
            dtype=torch.float64,
        )
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, clipped, kl_sum, entropy_sum = all_reduce(sums.tolist(), world)
    denom = max(total_tokens, 1)
    return {
        "loss": loss_sum / denom,
        "clip_frac": clipped / denom,
        "mismatch_kl": kl_sum / denom,
        "entropy": entropy_sum / denom,
        "grad_norm": float(grad_norm),
        "trained_tokens": int(total_tokens),
    }


def batch_stats(samples: list[Sample], step: int, world: World) -> dict:
    """Reward, staleness and token counts over every rank's samples."""
    staleness = [step - s.policy_version for s in samples]
    n, reward, tokens, stale_sum = all_reduce(
        [len(samples), sum(s.reward for s in samples), sum(len(s.input_ids) for s in samples), sum(staleness)], world
    )
    stale_max, = all_reduce([max(staleness, default=0)], world, dist.ReduceOp.MAX)
    return {
        "reward": reward / max(n, 1),
        "samples": int(n),
        "tokens": int(tokens),
        "staleness_mean": stale_sum / max(n, 1),
        "staleness_max": int(stale_max),
    }


def main() -> None:
    config = run_cli(TrainerConfig)
    logger = setup_logging("trainer")
    world = init_world()
    paths = RunPaths(config.output_dir)
    torch.manual_seed(config.seed)
    model, tokenizer = load_model(config, world)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay, betas=config.optim.betas
    )
    checkpointer = Checkpointer(paths, config.ckpt, world)
    metrics = MetricsLogger("trainer", paths, config.wandb, config.model_dump(mode="json"), logger) if world.is_main else None
    logger.info(f"rank {world.rank}/{world.world_size} on {world.device} ({world.backend}); training {config.max_steps} steps")
    for step in range(config.max_steps):
        wait_start = time.perf_counter()
        wait_for_stable(paths.rollouts(step), config.rollout_timeout_s, f"the orchestrator's batch for step {step}")
        samples = read_batch(paths, step, world.rank)
        start = time.perf_counter()
        stats = train_step(model, optimizer, samples, config, world, tokenizer.pad_token_id)
        stats |= batch_stats(samples, step, world)
        train_time = time.perf_counter() - start
        state = gather_full_state_dict(model)
        if world.is_main:
            publish_weights(paths, step + 1, state, model.config, tokenizer)
        step_time = time.perf_counter() - start
        stats |= {
            "wait_s": start - wait_start,
            "train_s": train_time,
            "step_time_s": step_time,
            "tokens_per_s": stats["tokens"] / train_time,
            "lr": config.optim.lr,
        }
        if config.ckpt.due(step + 1, config.max_steps):
            checkpointer.save(step + 1, model, optimizer)
        if metrics:
            metrics.log(step, stats, LINE_KEYS)
    if metrics:
        metrics.close()
    world.close()


if __name__ == "__main__":
    main()
