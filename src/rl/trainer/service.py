"""The trainer of `rl serve-api` (under torchrun): the service's calls (rl/calls.py), one at a time, in order.

    create_model       load the policy (LoRA of the asked rank, published merged; or every weight)
    forward_backward   score datums, add the loss's gradients (rl/trainer/tinker_ops.py); forward only: score
    optim_step         AdamW with the call's settings on the summed gradients, then zero them: policy v_k -> v_k+1
    save_for_sampler   publish weights/step_k of the current policy (as `rl`'s trainer does every step)
    save_state         a checkpoint of policy and optimizer at checkpoints/step_k/trainer
    load_state         back to such a checkpoint (its optimizer state too, if asked)

A call the trainer refuses (CallError: checked alike on every rank, before any collective) gets an error result and
the next call runs; any other error ends the trainer, as in `rl` (a rank failing inside a collective would leave the
others waiting in it)."""

from __future__ import annotations

import sys
import time

import torch
from transformers import AutoTokenizer

from rl.calls import call_dir, calls_so_far, finish_result, read_call, result_ready, wait_until, write_rank_result
from rl.config import ConfigError, run_cli
from rl.metrics import setup_logging
from rl.patches import check_internals
from rl.process import set_up_process
from rl.protocol import RunPaths, is_stable, stable_steps
from rl.trainer.checkpoint import Checkpointer
from rl.trainer.config import LoraConfig, TrainerConfig, check_device
from rl.trainer.data import filler_token_id
from rl.trainer.model import load_policy
from rl.trainer.optim import build_optimizer, build_scheduler, clip_gradients
from rl.trainer.tinker_ops import CallError, ModelLost, check_call, forward_backward
from rl.trainer.weights import FilesSender, WeightPublisher
from rl.trainer.world import World, init_world


class ServedPolicy:
    """The one model the service trains: its policy, optimizer and policy version (optimizer steps taken)."""

    def __init__(self, config: TrainerConfig, paths: RunPaths, world: World, lora_rank: int | None, seed: int):
        lora = None if lora_rank is None else LoraConfig(rank=lora_rank, publish_merged=True)
        # publish_in_background: save_for_sampler answers once the weights are gathered, as `rl`'s trainer trains on
        # while its step is written; the sampler loads a step only once its STABLE marker is there
        self.config = config.model_copy(update={"lora": lora, "seed": seed, "publish_in_background": True})
        self.world, self.paths = world, paths
        torch.manual_seed(seed)
        self.policy = load_policy(self.config, world)
        self.optimizer = build_optimizer(self.policy, self.config.optim)
        # unused (each optim_step sets its own LR) but held by checkpoints, as `rl`'s trainer's
        self.scheduler = build_scheduler(self.optimizer, self.config.optim, self.config.max_steps)
        tokenizer = AutoTokenizer.from_pretrained(self.config.model.name)
        self.pad_id = filler_token_id(tokenizer)
        self.vocab_size = self.policy.config.get_text_config().vocab_size
        self.publisher = WeightPublisher.for_config(self.config, paths, self.policy, tokenizer, world)
        self.sender = FilesSender(self.publisher)
        self.checkpointer = Checkpointer(paths, self.config.ckpt.model_copy(update={"keep": 10**6}), world)
        self.step = unused_step(paths)
        self.published: int | None = None  # the last step handed to the publisher

    def forward_backward(self, call: dict, tensors: dict[str, torch.Tensor]) -> dict:
        datums = [{name.split("/", 1)[1]: t for name, t in tensors.items() if name.startswith(f"{i}/")}
                  for i in range(call["datums"])]
        check_call(call["loss_fn"], call["loss_fn_config"], datums, self.config.seq_len, self.vocab_size)
        mine = list(range(self.world.rank, len(datums), self.world.world_size))
        outputs, loss = forward_backward(self.policy, [datums[i] for i in mine], call["loss_fn"],
                                         call["loss_fn_config"], not call["forward_only"], self.config.row_tokens,
                                         self.pad_id, self.world)
        write_rank_result(self.paths, call["n"], self.world.rank,
                          {f"logprobs/{mine[i]}": lp for i, lp in outputs.items()})
        total, = self.world.all_reduce([loss])
        return {"metrics": {"loss:sum": total}, "step": self.step}

    def optim_step(self, call: dict) -> dict:
        adam = call["adam_params"]
        for group in self.optimizer.param_groups:
            group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                         weight_decay=adam["weight_decay"])
        norm = clip_gradients(self.policy, adam["grad_clip_norm"] or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"metrics": {"grad_norm:mean": norm}, "step": self.step}

    def save_for_sampler(self) -> dict:
        if self.published != self.step and not is_stable(self.paths.weights(self.step)):
            self.sender.publish(self.step, self.policy)
            self.published = self.step
        return {"step": self.step}

    def save_state(self) -> dict:
        self.publisher.wait()
        self.checkpointer.save(self.step, self.policy, self.optimizer, self.scheduler)
        return {"step": self.step}

    def load_state(self, call: dict) -> dict:
        self.publisher.wait()  # unused_step below counts the step being written
        self.checkpointer.load(call["step"], self.policy, self.optimizer, self.scheduler)
        if not call["optimizer"]:  # the weights alone: the optimizer starts afresh
            self.optimizer = build_optimizer(self.policy, self.config.optim)
        self.optimizer.zero_grad(set_to_none=True)
        self.step = unused_step(paths=self.paths)
        return {"step": self.step}

    def close(self) -> None:
        self.publisher.close()


def unused_step(paths: RunPaths) -> int:
    """The policy version a new or reloaded model starts from: past every step published or saved in the run, so
    that no two policies share a weights/step_k (which a sampler would then serve for both) or a checkpoint (which a
    saved state names). The service's first model starts at 0, the base model inference serves."""
    taken = stable_steps(paths.weights_root) + paths.checkpoint_steps("trainer")
    return max(taken, default=-1) + 1


LOST = ("the trainer was restarted (its process died) since this model was created, and the model went with it: "
        "load a saved state (ServiceClient.create_training_client_from_state)")


def resume_calls(paths: RunPaths, world: World) -> int:
    """The first call this trainer runs. A trainer restarted by `rl serve-api` fails the call its predecessor died
    in (the service is waiting on it) and takes the calls after it."""
    n = calls_so_far(paths)
    if world.is_main and n and not result_ready(paths, n - 1):
        finish_result(paths, n - 1, {"error": LOST, "category": "server", "model_lost": True})
    world.barrier()
    return n


def run_call(served: ServedPolicy | None, call: dict, tensors: dict, make, restarted: bool
             ) -> tuple[ServedPolicy | None, dict]:
    op = call["op"]
    if op == "create_model":  # the service lets a new model replace one whose session ended
        if served is not None:
            served.close()
        made = make(call["lora_rank"], call["seed"])
        return made, {"step": made.step}
    if served is None:
        raise ModelLost(LOST) if restarted else CallError(f"{op} before create_model: no model is loaded")
    if op == "forward_backward":
        return served, served.forward_backward(call, tensors)
    if op == "optim_step":
        return served, served.optim_step(call)
    if op == "save_for_sampler":
        return served, served.save_for_sampler()
    if op == "save_state":
        return served, served.save_state()
    if op == "load_state":
        return served, served.load_state(call)
    raise CallError(f"unknown call {op!r}")


def main() -> None:
    set_up_process()
    config = run_cli(TrainerConfig)
    try:
        check_device(config)
        check_internals("trainer")  # what rl reads of torch's and transformers' internals is there
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    logger = setup_logging("trainer")
    world = init_world()
    paths = RunPaths(config.output_dir)
    logger.info(f"rank {world.rank}/{world.world_size} on {world.device}: waiting for the service's calls")
    served: ServedPolicy | None = None
    make = lambda rank, seed: ServedPolicy(config, paths, world, rank, seed)  # noqa: E731
    n = resume_calls(paths, world)
    restarted = n > 0
    try:
        while True:
            wait_until(lambda: is_stable(call_dir(paths, n)), config.batch_timeout_s, f"the service's call {n}")
            call, tensors = read_call(paths, n)
            if call["op"] == "stop":
                break
            start = time.perf_counter()
            try:
                served, result = run_call(served, call | {"n": n}, tensors, make, restarted)
            except ModelLost as e:
                result = {"error": str(e), "category": "server", "model_lost": True}
            except (CallError, FileNotFoundError) as e:
                result = {"error": str(e), "category": "user"}
            world.barrier()  # every rank's part is written
            if world.is_main:
                finish_result(paths, n, result | {"time_s": time.perf_counter() - start})
            logger.info(f"call {n} {call['op']}: {result.get('error') or 'done'} in {time.perf_counter() - start:.2f}s")
            n += 1
    finally:
        if served is not None:
            served.close()
        world.close()


if __name__ == "__main__":
    main()
