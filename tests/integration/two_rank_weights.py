"""Run under torchrun by test_trainer_weights_two_ranks.py: load a model on the meta device (each rank reads its
rows), then publish it as bf16 shards written by both ranks. Rank 0 prints one JSON line of what it measured."""

import json
import resource
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from rl.protocol import RunPaths
from rl.trainer.model import load_model
from rl.trainer.weights import WeightPublisher
from rl.trainer.world import init_world


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def main(model_dir: str, run_dir: str, shard_bytes: int) -> None:
    world = init_world()
    before = max_rss_mib()
    model = load_model(model_dir, "float32", world)
    load_rss = max_rss_mib() - before
    publisher = WeightPublisher(RunPaths(Path(run_dir)), AutoConfig.from_pretrained(model_dir),
                                AutoTokenizer.from_pretrained(model_dir), world, torch.bfloat16, shard_bytes, False)
    publisher.publish(1, model)
    publisher.close()
    rss = world.all_reduce([load_rss], op="max")[0]
    if world.is_main:
        print(json.dumps({"load_rss_mib": rss, "world_size": world.world_size}))
    world.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
