"""What only a GPU can show (skipped without CUDA; `scripts/gpu-check.sh` runs them with a short Qwen3-0.6B run):
a bf16 step published by the trainer's path reloads into a CUDA vLLM (one GPU, and a TP=2 server on two, each worker
proving its shard) and verifies by its checksum, and the GPU split gives every child its own devices. The bf16
training step is in test_trainer.py, chunked logprobs on CUDA in tests/unit/test_chunked_logprobs.py."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rl.inference.fingerprint import checkpoint_fingerprint
from rl.protocol import RunPaths
from rl.tiny_model import build_tiny_model
from rl.trainer.weights import DEFAULT_SHARD_BYTES, hf_side_files, publish_step, single_process_shards
from tests.conftest import ROOT
from tests.integration.inference_server import Server

pytestmark = [pytest.mark.integration, pytest.mark.gpu]


def test_a_bf16_step_reloads_into_cuda_vllm_and_verifies(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    model_dir = build_tiny_model(tmp_path / "model")
    paths = RunPaths(tmp_path / "run")
    paths.weights_root.mkdir(parents=True)
    # device defaults: --dtype auto, CUDA graphs
    server = Server(model_dir, paths.weights_root, tmp_path / "inference.log")
    try:
        base = load_file(str(model_dir / "model.safetensors"))
        g = torch.Generator().manual_seed(1)
        state = {k: (v + 0.05 * v.std() * torch.randn(v.shape, generator=g)).bfloat16() for k, v in base.items()}
        side = hf_side_files(AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir))
        publish_step(paths, 1, single_process_shards(state, DEFAULT_SHARD_BYTES), side)
        response = server.admin("POST", "/update_weights", json={"step": 1, "path": str(paths.weights(1))})
        assert response.status_code == 200, response.text
        _, checksum = checkpoint_fingerprint(paths.weights(1), torch.bfloat16, tied=True)
        assert response.json()["weights_checksum"] == checksum
        assert server.admin("GET", "/policy_step").json()["weights_checksum"] == checksum
        prompt = [1, 91, 89, 75, 88, 5]
        completion, logprobs = server.generate(prompt, max_tokens=8)
        assert len(completion) == 8 and all(lp <= 0 for lp in logprobs)
        # what is served computes what the published weights compute, through the API with CUDA graphs on: stale
        # weights in a captured graph (which the fingerprint, read through the eager path, would not see) fail here
        expected = transformers_logprobs(paths.weights(1), prompt, completion)
        assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 0.1, (logprobs, expected)
        assert sum(abs(a - b) for a, b in zip(logprobs, expected)) / len(expected) < 0.03, (logprobs, expected)
    finally:
        server.stop()


def transformers_logprobs(model_dir, prompt: list[int], completion: list[int]) -> list[float]:
    """The completion's logprobs under transformers' bf16 forward of `model_dir` (fp32 softmax, temperature 1, as
    vLLM samples). bf16 bounds: two bf16 forwards with different kernels differ by ~1e-2 per logprob."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0].tolist()


def test_the_gpu_split_gives_each_child_its_own_devices(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model_dir = build_tiny_model(tmp_path / "model")
    cmd = [sys.executable, "-m", "rl.launcher.main", "--trainer", "@", str(ROOT / "configs/reverse_text/train.toml"),
           "--orchestrator", "@", str(ROOT / "configs/reverse_text/orch.toml"),
           "--inference", "@", str(ROOT / "configs/reverse_text/infer.toml"),
           "--model.name", str(model_dir), "--trainer-gpus", "1", "--inference-gpus", "1",
           "--output-dir", str(tmp_path / "run"), "--dry-run"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {
        line.split(":", 1)[0]: line for line in out.stdout.splitlines() if line.startswith(("trainer:", "inference"))
    }
    trainer = next(v for k, v in lines.items() if k.startswith("trainer"))
    inference = next(v for k, v in lines.items() if k.startswith("inference"))
    assert "CUDA_VISIBLE_DEVICES=" in trainer and "CUDA_VISIBLE_DEVICES=" in inference
    visible = lambda line: line.split("CUDA_VISIBLE_DEVICES=")[1].split()[0]  # noqa: E731
    assert visible(trainer) != visible(inference)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in trainer
    assert "trainer.dtype = bfloat16 (auto: CUDA)" in out.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one TP=2 server)")
def test_a_tp2_cuda_server_reloads_verifies_each_shard_and_rolls_back_a_wrong_one(tmp_path):
    """A TP=2 server on two GPUs (NCCL between its workers, CUDA graphs): a bf16 step reloads and verifies on both
    workers with the files' checksum; a row changed on worker 1's shard after its fingerprint (rl's test hook) is
    refused naming worker 1 and the tensor, and the verified step keeps serving."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = build_tiny_model(tmp_path / "model")
    paths = RunPaths(tmp_path / "run")
    paths.weights_root.mkdir(parents=True)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    server = Server(model_dir, paths.weights_root, tmp_path / "inference.log",
                    toml="tensor_parallel_size = 2\ngpu_memory_utilization = 0.4\n",
                    env={"CUDA_VISIBLE_DEVICES": "0,1", "RL_TEST_HOOK_DIR": str(hooks)})
    try:
        base = load_file(str(model_dir / "model.safetensors"))
        side = hf_side_files(AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir))
        for step in (1, 2):
            g = torch.Generator().manual_seed(step)
            state = {k: (v + 0.05 * v.std() * torch.randn(v.shape, generator=g)).bfloat16() for k, v in base.items()}
            publish_step(paths, step, single_process_shards(state, DEFAULT_SHARD_BYTES), side)
        response = server.admin("POST", "/update_weights", json={"step": 1, "path": str(paths.weights(1))})
        assert response.status_code == 200, response.text
        assert response.json()["weights_checksum"] == checkpoint_fingerprint(paths.weights(1), torch.bfloat16,
                                                                             tied=True)[1]
        before = server.generate([1, 91, 89, 75, 88, 5], max_tokens=8, temperature=0.0)
        (hooks / "corrupt_reload").write_text("model.layers.1.self_attn.q_proj.weight 100 1")
        response = server.admin("POST", "/update_weights", json={"step": 2, "path": str(paths.weights(2))})
        assert response.status_code == 500, response.text
        assert "worker 1: model.layers.1.self_attn.q_proj.weight: exact part differs" in response.text
        assert server.admin("GET", "/policy_step").json()["step"] == 1
        assert server.generate([1, 91, 89, 75, 88, 5], max_tokens=8, temperature=0.0) == before
    finally:
        server.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the sender on one, the server on another")
def test_over_nccl_a_cuda_server_takes_a_step_into_its_first_workers_gpu_and_verifies_it_on_every_worker(tmp_path):
    """`transfer.backend = "nccl"` end to end on GPUs: the trainer's sender (this process, cuda:0) broadcasts a bf16
    step over NCCL into the first worker of a server (TP=2 on GPUs 1 and 2 where there are 3, else TP=1 on GPU 1),
    which stages it; every worker loads and verifies it with the trainer's checksum; a step altered on the way is
    refused before anything loads, and so is one from a sender without the run's secret."""
    from rl.weights.config import CollectiveTransfer
    from rl.trainer.transfer import CollectiveSender
    from tests.integration.test_inference_tp import send_over_the_wire
    from tests.unit.test_transfer import SECRET

    model_dir = build_tiny_model(tmp_path / "model")
    paths = RunPaths(tmp_path / "run")
    paths.weights_root.mkdir(parents=True)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    tp = 2 if torch.cuda.device_count() >= 3 else 1
    server = Server(model_dir, paths.weights_root, tmp_path / "inference.log",
                    toml=f'tensor_parallel_size = {tp}\ngpu_memory_utilization = 0.4\n[transfer]\nbackend = "nccl"\n'
                         f'secret = "{SECRET}"\n',
                    env={"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(1, tp + 1)),
                         "RL_TEST_HOOK_DIR": str(hooks)})
    world = type("World", (), {"is_main": True, "rank": 0, "world_size": 1, "on_gpu": True,
                               "device": torch.device("cuda", 0), "all_reduce": lambda self, v, op="sum": v})()
    torch.cuda.set_device(0)
    wire = CollectiveTransfer(backend="nccl", secret=SECRET, timeout_s=60, offer_timeout_s=120)
    sender = CollectiveSender(wire, tmp_path / "wire", world, torch.bfloat16, first_step=0)
    try:
        base = load_file(str(model_dir / "model.safetensors"))
        g = torch.Generator().manual_seed(1)
        state = {k: (v + 0.05 * v.std() * torch.randn(v.shape, generator=g)).bfloat16().cuda() for k, v in base.items()}
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        tensors = list(state.items())
        before = server.generate([1, 91, 89, 75, 88, 5], max_tokens=8, temperature=0.0)
        (hooks / "corrupt_receive").write_text("model.layers.0.mlp.up_proj.weight")
        answer, sent = send_over_the_wire(server, sender, tmp_path / "wire", 1, tensors)
        assert answer.status_code == 422 and "arrived altered" in answer.text, answer.text
        assert server.generate([1, 91, 89, 75, 88, 5], max_tokens=8, temperature=0.0) == before
        answer, sent = send_over_the_wire(server, sender, tmp_path / "wire", 2, tensors)
        assert answer.status_code == 200, answer.text
        assert answer.json()["weights_checksum"] == sent["weights_checksum"]
        assert server.admin("GET", "/policy_step").json()["step"] == 2
        assert server.generate([1, 91, 89, 75, 88, 5], max_tokens=8, temperature=0.0) != before
        assert "received over nccl by the first worker" in (tmp_path / "inference.log").read_text()
        # an outsider in rank 0's place, without the run's secret: its header is refused by the first worker
        outsider = CollectiveSender(wire.model_copy(update={"secret": "an outsider's guess"}), tmp_path / "outsider",
                                    world, torch.bfloat16, first_step=0)
        try:
            answer, _ = send_over_the_wire(server, outsider, tmp_path / "outsider", 3,
                                           [(name, torch.zeros_like(t)) for name, t in tensors])
        finally:
            outsider.close()
        assert answer.status_code == 403 and "not sealed with this run's transfer secret" in answer.text, answer.text
        assert server.admin("GET", "/policy_step").json()["step"] == 2
    finally:
        sender.close()
        server.stop()
