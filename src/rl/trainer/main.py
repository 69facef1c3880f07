"""Trainer entrypoint (run under torchrun): wait for batch -> forward/backward -> optimizer step ->
publish weights -> log -> checkpoint, once per step."""

from __future__ import annotations

import os
import shutil
import sys
import time
from functools import partial
from typing import Callable

import torch
from transformers import AutoTokenizer

from rl.config import ConfigError, run_cli
from rl.metrics import MetricsLogger, setup_logging
from rl.protocol import RunPaths, read_batch, stable_steps, wait_for_stable
from rl.samples import Sample
from rl.trainer.checkpoint import Checkpointer
from rl.trainer.config import TrainerConfig, check_device
from rl.trainer.data import filler_token_id
from rl.trainer.flops import frozen_matmul_params, matmul_params, peak_flops, train_flops
from rl.trainer.model import load_policy, load_reference
from rl.trainer.lora import lora_layers
from rl.trainer.optim import build_optimizer, build_scheduler, trained_parameters
from rl.trainer.step import train_step
from rl.trainer.weights import WeightPublisher
from rl.trainer.world import World, init_world
from rl.weights import SENDERS
from rl.patches import check_internals
from rl.process import set_up_process

LINE_KEYS = (
    "loss", "reward", "entropy", "clip_frac", "mismatch_kl", "mismatch_corr", "masked_frac", "ratio_p99", "grad_norm",
    "lr", "tokens_per_s", "mfu", "step_time_s",
    "time/wait_for_batch",
    "distill/reverse_kl", "distill/top_k_kl",  # with a teacher: the reverse KL per trained token, the top-k one
    "transfer_s", "transfer_bytes",  # over the wire: how long the step took to send, and how much of it travelled
)


def wait_for_batch(paths: RunPaths, step: int, config: TrainerConfig, world: World) -> list[Sample]:
    wait_for_stable(paths.rollouts(step), config.batch_timeout_s, f"the orchestrator's batch for step {step}")
    return read_batch(paths, step, world.rank)


def batch_stats(samples: list[Sample], step: int, world: World, model_flops: Callable[[list[int]], float]) -> dict:
    """Reward, staleness, token counts and model FLOPs over every rank's samples."""
    staleness = [step - s.policy_version for s in samples]
    lengths = [len(s.input_ids) for s in samples]
    n, reward, tokens, stale_sum, flops = world.all_reduce(
        [len(samples), sum(s.reward for s in samples), sum(lengths), sum(staleness), model_flops(lengths)]
    )
    stale_max, = world.all_reduce([max(staleness, default=0)], op="max")
    return {
        "reward": reward / max(n, 1),
        "samples": int(n),
        "tokens": int(tokens),
        "staleness_mean": stale_sum / max(n, 1),
        "staleness_max": int(stale_max),
        "flops": flops,
    }


def describe_lora(model: torch.nn.Module) -> str:
    layers = lora_layers(model)
    trained = sum(p.numel() for p in trained_parameters(model))
    total = sum(p.numel() for p in model.parameters())
    return f"LoRA on {len(layers)} layers: {trained:,} of {total:,} parameters trained ({trained / total:.2%})"


def prune_run_files(paths: RunPaths, step: int, config: TrainerConfig) -> None:
    """After step `step` published weights/step_{step+1}: delete rollouts and weights no process can need.

    Weights of checkpointed steps stay: a resume moves inference back to them."""
    for old in stable_steps(paths.rollouts_root):
        if old <= step - config.keep_rollouts:
            shutil.rmtree(paths.rollouts(old), ignore_errors=True)
    checkpointed = set(paths.checkpoint_steps("trainer"))
    for old in stable_steps(paths.weights_root):
        if old <= step + 1 - config.keep_weights and old not in checkpointed:
            shutil.rmtree(paths.weights(old), ignore_errors=True)


def timing_stats(
    stats: dict, wait_s: float, train_s: float, step_s: float, world: World, device_peak: float | None
) -> dict:
    reserved = world.peak_reserved_gib()
    peaks = world.all_reduce([world.peak_memory_gib()] + ([reserved] if reserved is not None else []), op="max")
    timing = {
        "time/wait_for_batch": wait_s,  # the orchestrator's side of the same wait: its time/wait_for_policy
        "train_s": train_s,
        "step_time_s": step_s,
        "tokens_per_s": stats["tokens"] / train_s,
        "peak_mem_gib": peaks[0],
    }
    if reserved is not None:  # GPUs only: what the allocator held, fragmentation included
        timing["peak_reserved_gib"] = peaks[1]
    if device_peak is not None:  # GPUs with a known peak only
        timing["mfu"] = stats["flops"] / (train_s * device_peak * world.world_size)
    return timing


def main() -> None:
    set_up_process()
    config = run_cli(TrainerConfig)
    try:
        check_device(config)
        check_internals("trainer")  # what rl reads of torch's and transformers' internals is there
    except ConfigError as e:  # exit 2, as every entrypoint does on a config error
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    logger = setup_logging("trainer")
    world = init_world()
    paths = RunPaths(config.output_dir)
    paths.make_private()
    torch.manual_seed(config.seed)
    if config.deterministic:  # cuBLAS's deterministic workspace must be set before its first handle
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    policy = load_policy(config, world)
    reference = load_reference(config, world, policy)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    text = policy.config.get_text_config()  # a vision-language model's language model
    model_flops = partial(
        train_flops, matmul_params(policy), text.num_hidden_layers, text.hidden_size,
        frozen=frozen_matmul_params(policy),
    )
    device_peak, peak_part = peak_flops(world.device) or (None, None)
    optimizer = build_optimizer(policy, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.max_steps)
    checkpointer = Checkpointer(paths, config.ckpt, world)
    first_step = config.resume_step or 0
    if config.resume_step is not None:
        checkpointer.load(config.resume_step, policy, optimizer, scheduler)
    metrics = (
        MetricsLogger("trainer", paths, config.wandb, config, logger) if world.is_main else None
    )
    publisher = WeightPublisher.for_config(config, paths, policy, tokenizer, world)
    sender = SENDERS.load(config.transfer.engine).create(config, publisher, world, first_step)
    sender.check(policy)  # before any step is trained
    threads = "" if world.on_gpu else f", {torch.get_num_threads()} torch threads"  # torchrun's 1 per rank or more
    logger.info(
        f"rank {world.rank}/{world.world_size} on {world.device} ({world.backend}{threads}); "
        f"steps {first_step}..{config.max_steps - 1}" + (f"; {describe_lora(policy)}" if config.lora else "")
        + (f"; MFU against the {peak_part} peak, {device_peak / 1e12:.0f} TFLOP/s bf16 dense" if peak_part else "")
    )
    if publisher.adapter and first_step == 0:  # inference loads the adapter of step 0 (B = 0) before any rollout
        if checksum := sender.publish(0, policy).get("adapter_checksum"):
            logger.info(f"published the step-0 adapter (checksum {checksum})")
    for step in range(first_step, config.max_steps):
        wait_start = time.perf_counter()
        samples = wait_for_batch(paths, step, config, world)
        start = time.perf_counter()
        stats = train_step(policy, reference, optimizer, scheduler, samples, config, world, filler_token_id(tokenizer))
        stats |= batch_stats(samples, step, world, model_flops)
        train_s = time.perf_counter() - start
        stats |= sender.publish(step + 1, policy)
        stats |= timing_stats(stats, start - wait_start, train_s, time.perf_counter() - start, world, device_peak)
        world.reset_peak_memory()  # peak_mem_gib is each step's own (on GPUs)
        if metrics:  # before the checkpoint: a resume from step + 1 never logs this step again
            metrics.log(step, stats, LINE_KEYS)
        if config.ckpt.due(step + 1, config.max_steps):
            publisher.wait()  # a resume serves the checkpointed step's weights: they must be on disk
            checkpointer.save(step + 1, policy, optimizer, scheduler)
        if world.is_main:
            prune_run_files(paths, step, config)
    sender.close()
    publisher.close()
    if metrics:
        metrics.close()
    world.close()


if __name__ == "__main__":
    main()
