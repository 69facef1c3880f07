"""The families users bring beside Qwen3, each trained through `rl` (issues 80, 86): Llama 3 (an untied head),
Qwen2.5 (q/k/v biases), Gemma 3 (sliding and full attention, a scaled embedding, (1 + w) norms) and Qwen3.5 (Gated
DeltaNet linear attention in three layers of four, a recurrent state per sequence in the server), built by
`tiny-model --arch`. On-policy (async level 0), so every step's weights are published, reloaded by the server in
place and proved there (the served checksum in the orchestrator's record) before the next batch is made. One run
per family; the mixtures of experts (qwen3_moe, qwen3_5_moe) also resume, on a tensor-parallel server, with router
replay."""

import subprocess
import sys

import pytest

from rl.protocol import RunPaths, read_metrics
from tests.integration.launched import Launched, rl_command

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "qwen3_5"])
def test_a_family_trains_three_steps_each_published_served_and_proved(arch, tmp_path):
    model = tmp_path / arch
    subprocess.run([sys.executable, "-m", "rl.tiny_model", "--out", str(model), "--arch", arch], check=True,
                   capture_output=True)
    out = tmp_path / "run"
    run = Launched(rl_command(model, out, 3, "--async-level", "0"))
    assert run.wait(timeout=300) == 0, "".join(run.lines[-60:])
    records = read_metrics(RunPaths(out))
    assert [m["step"] for m in records if m["process"] == "trainer"] == [0, 1, 2]
    served = {m["step"]: m.get("served_checksums") for m in records if m["process"] == "orchestrator"}
    assert served[0] is None and all(served[step] and all(served[step]) for step in (1, 2)), served
    assert served[1] != served[2]  # each step's own weights
    (log,) = (out / "logs").glob("inference*.log")
    assert all(f"serving step {step}" in log.read_text() for step in (1, 2))
    if arch == "qwen3_5":  # served in float32 (rl's GDN op on CPU), trained in float32: the same distribution
        assert all(m["mismatch_kl"] <= 1e-6 for m in records if m["process"] == "trainer"), records


def test_merged_lora_on_qwen3_5_adapts_its_linear_attention_and_serves_on_two_workers(tmp_path):
    """LoRA on Qwen3.5's Gated DeltaNet projections and its attention's, published merged (vLLM 0.32's CPU linear
    attention takes no adapter), served by 2 tensor-parallel workers that prove their shards of every step."""
    model = tmp_path / "qwen3_5"
    subprocess.run([sys.executable, "-m", "rl.tiny_model", "--out", str(model), "--arch", "qwen3_5"], check=True,
                   capture_output=True)
    out = tmp_path / "run"
    targets = '["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"]'
    run = Launched(rl_command(model, out, 3, "--async-level", "0", "--trainer.lora.rank", "8",
                              "--trainer.lora.target-modules", targets, "--trainer.lora.publish-merged", "true",
                              "--trainer.optim.lr", "5e-3", "--inference.tensor-parallel-size", "2"))
    assert run.wait(timeout=300) == 0, "".join(run.lines[-60:])
    records = read_metrics(RunPaths(out))
    served = {m["step"]: m.get("served_checksums") for m in records if m["process"] == "orchestrator"}
    assert served[1] and served[2] and served[1] != served[2], served
    # 3 linear-attention layers x 3 projections, 1 attention layer x 4
    assert "LoRA on 13 layers" in (out / "logs" / "trainer.log").read_text()


def test_lora_on_llama_serves_each_adapter_the_trainer_made(tmp_path):
    """LoRA on a family other than Qwen3: each step's adapter (7 projections of 4 layers, an untied head left
    alone) is loaded by the server and served with the checksum the trainer gave it."""
    model = tmp_path / "llama"
    subprocess.run([sys.executable, "-m", "rl.tiny_model", "--out", str(model), "--arch", "llama"], check=True,
                   capture_output=True)
    out = tmp_path / "run"
    run = Launched(rl_command(model, out, 3, "--async-level", "0", "--trainer.lora.rank", "8",
                              "--trainer.optim.lr", "5e-3"))
    assert run.wait(timeout=300) == 0, "".join(run.lines[-60:])
    records = read_metrics(RunPaths(out))
    made = {m["step"] + 1: m["adapter_checksum"] for m in records if m["process"] == "trainer"}
    served = {m["step"]: m["served_checksums"] for m in records if m["process"] == "orchestrator"}
    assert served[1] == [made[1]] and served[2] == [made[2]] and made[1] != made[2], (made, served)
    assert "LoRA on 28 layers" in (out / "logs" / "trainer.log").read_text()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_the_moe_trains_with_router_replay_resumes_and_is_served_by_two_workers(arch, tmp_path):
    """Qwen3-MoE and Qwen3.5-MoE (its shared expert, its linear attention): 2 steps on one worker, then resumed from
    the step-1 checkpoint to step 3 on a server of 2 tensor-parallel workers (each expert's rows split across them,
    every shard proved). Inference records each token's experts, the trainer routes every token as recorded; in
    float32 the trainer's own router picks the recorded experts (so the record is aligned with its tokens), and
    trainer and inference logprobs agree. Every layer of both is sparse, so the record has one row per layer."""
    model = tmp_path / "moe"
    subprocess.run([sys.executable, "-m", "rl.tiny_model", "--out", str(model), "--arch", arch], check=True,
                   capture_output=True)
    out = tmp_path / "run"
    first = Launched(rl_command(model, out, 2, "--async-level", "0", "--ckpt.interval", "1"))
    assert first.wait(timeout=300) == 0, "".join(first.lines[-60:])
    resumed = Launched(rl_command(model, out, 3, "--async-level", "0", "--ckpt.interval", "1", "--resume",
                                  "--inference.tensor-parallel-size", "2"))
    assert resumed.wait(timeout=300) == 0, "".join(resumed.lines[-60:])
    records = read_metrics(RunPaths(out))
    trained = {m["step"]: m for m in records if m["process"] == "trainer"}
    assert sorted(trained) == [0, 1, 2]
    for m in trained.values():
        assert m["moe/router_agreement"] > 0.95 and m["mismatch_kl"] < 1e-3, m
        assert 0 < m["moe/router_entropy"] and 1 / 8 <= m["moe/max_expert_share"] <= 1
        assert "router_replay/unrouted" not in m
    served = {m["step"]: m.get("served_checksums") for m in records if m["process"] == "orchestrator"}
    assert served[1] and served[2] and len(served[2]) == 1 and served[1] != served[2], served
    logs = sorted((out / "logs").glob("inference*.log"))
    assert any("serving step 2" in log.read_text() for log in logs)
