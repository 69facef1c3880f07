"""Two gloo ranks: the model is built on the meta device and each rank reads only its rows (peak memory at load
below the model's size), and every rank writes its own bf16 shards of a published step, which loads with
`from_pretrained` as the model's weights cast to bf16."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl.protocol import RunPaths, verify_stable
from rl.tiny_model import build_tiny_model
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_two_ranks_load_their_rows_and_write_their_shards(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", hidden_size=768, layers=14, heads=12, kv_heads=4)  # ~100M
    model_mib = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 2**20
    shard_bytes = int(model_mib * 2**20 / 2 / 5)  # bf16 halves the model: ~5 shards, shared by the two ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "integration" / "two_rank_weights.py"),
           str(model_dir), str(tmp_path / "run"), str(shard_bytes)]
    # on the CPU also on a GPU host: host memory (RSS) is what it measures
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"per-rank peak RSS growth at load {measured['load_rss_mib']:.0f} MiB, model {model_mib:.0f} MiB")
    assert measured["load_rss_mib"] < 0.75 * model_mib

    step = RunPaths(tmp_path / "run").weights(1)
    verify_stable(step)
    shards = sorted(step.glob("*.safetensors"))
    assert len(shards) >= 4 and (step / "model.safetensors.index.json").is_file()
    expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor.bfloat16().float()), name
