"""What only a GPU can show (skipped without CUDA; `scripts/gpu-check.sh` runs them with a short Qwen3-0.6B run):
a bf16 step published by the trainer's path reloads into a CUDA vLLM (one GPU, and a TP=2 server on two, each worker
proving its shard) and verifies by its checksum; over NCCL, steps arrive while a generate loop runs (the group formed
once, with generation held) and a trainer killed mid-step leaves the server serving and the next trainer's group
forming anew; the GPU split gives every child its own devices; an MoE's bf16 step reloads into CUDA vLLM,
every expert proved, with each token's experts in the generate reply (vLLM's own recorder); and Qwen3.5's hybrid
(Gated DeltaNet) dense and MoE steps reload into CUDA vLLM (its Triton GDN kernels), every tensor proved, and serve
what transformers computes, and with its vision tower answers a picture. The bf16 training step
is in test_trainer.py, chunked logprobs on CUDA in tests/unit/test_chunked_logprobs.py."""

import contextlib
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rl.inference.fingerprint import checkpoint_fingerprint
from rl.protocol import RunPaths
from rl.tiny_model import build_tiny_model
from rl.trainer.weights import DEFAULT_SHARD_BYTES, hf_side_files, publish_step, single_process_shards
from tests.conftest import ROOT
from tests.integration.inference_server import Server
from tests.unit.test_transfer import SECRET

pytestmark = [pytest.mark.integration, pytest.mark.gpu]


def reload_a_perturbed_step(server, model_dir, paths: RunPaths, seed: int) -> str:
    """The model's weights moved a little (by `seed`) published in bf16 as step 1, loaded by `server` and verified
    there: the weights checksum it reports is the files'. Returns it."""
    from transformers import AutoConfig, AutoTokenizer

    base = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    state = {k: (v + 0.05 * v.std() * torch.randn(v.shape, generator=g)).bfloat16() for k, v in base.items()}
    side = hf_side_files(AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir))
    publish_step(paths, 1, single_process_shards(state, DEFAULT_SHARD_BYTES), side)
    response = server.admin("POST", "/update_weights", json={"step": 1, "path": str(paths.weights(1))})
    assert response.status_code == 200, response.text
    _, checksum = checkpoint_fingerprint(paths.weights(1), torch.bfloat16, tied=True)
    assert response.json()["weights_checksum"] == checksum
    return checksum


@contextlib.contextmanager
def tiny_model_served(tmp_path, arch: str):
    """A tiny model of `arch` served by one CUDA server (device defaults) whose weights directory is the run's:
    (server, the model's directory, the run's paths); the server stopped after."""
    model_dir = build_tiny_model(tmp_path / arch, arch=arch)
    paths = RunPaths(tmp_path / "run")
    paths.weights_root.mkdir(parents=True)
    server = Server(model_dir, paths.weights_root, tmp_path / "inference.log")
    try:
        yield server, model_dir, paths
    finally:
        server.stop()


def test_a_bf16_step_reloads_into_cuda_vllm_and_verifies(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model")
    paths = RunPaths(tmp_path / "run")
    paths.weights_root.mkdir(parents=True)
    # device defaults: --dtype auto, CUDA graphs
    server = Server(model_dir, paths.weights_root, tmp_path / "inference.log")
    try:
        checksum = reload_a_perturbed_step(server, model_dir, paths, seed=1)
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


def test_an_moe_step_reloads_into_cuda_vllm_every_expert_proved_and_replies_carry_the_routing(tmp_path):
    """The tiny Qwen3-MoE on one GPU with router replay on (vLLM's --enable-return-routed-experts, its V2 runner's
    recorder): a perturbed bf16 step reloads and verifies (each expert read back from the CUDA kernel's buffers and
    checked against what the kernel computes), and a generate reply carries one row per computed token, [prompt +
    completion - 1, layers, top_k], in the form verifiers' client reads."""
    import base64

    import numpy as np

    with tiny_model_served(tmp_path, "qwen3_moe") as (server, model_dir, paths):
        reload_a_perturbed_step(server, model_dir, paths, seed=2)
        body = {"model": str(model_dir), "token_ids": PROMPT,
                "sampling_params": {"max_tokens": 8, "temperature": 1.0, "logprobs": 1, "seed": 0}}
        reply = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()
    routed = reply["choices"][0]["routed_experts"]
    rows = np.frombuffer(base64.b64decode(routed["data"]), dtype=routed["dtype"]).reshape(routed["shape"])
    completion = reply["choices"][0]["token_ids"]
    assert routed["start"] == 0 and rows.shape == (len(PROMPT) + len(completion) - 1, 4, 2)
    assert rows.max() < 8


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_a_qwen3_5_step_reloads_into_cuda_vllm_every_linear_attention_tensor_proved(arch, tmp_path):
    """The tiny Qwen3.5 (dense and MoE) on one GPU: a perturbed bf16 step reloads and verifies (the convolution,
    A_log, dt_bias, in_proj_qkv across vLLM's q/k/v parts, the shared expert), and the served logprobs are
    transformers' bf16 forward of the step within bf16's rounding."""
    with tiny_model_served(tmp_path, arch) as (server, model_dir, paths):
        reload_a_perturbed_step(server, model_dir, paths, seed=3)
        completion, logprobs = server.generate(PROMPT, max_tokens=8)
        expected = transformers_logprobs(paths.weights(1), PROMPT, completion)
    assert sum(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) / len(expected) < 0.05, (
        logprobs, expected)


def test_qwen3_5_with_images_reloads_into_cuda_vllm_its_vision_tower_proved_and_answers_a_picture(tmp_path):
    """The tiny Qwen3.5 with its vision tower (`qwen3_5_vl`) on one GPU: a perturbed bf16 step reloads and verifies,
    vision tensors included, and a chat with a picture (as count-shapes sends it) is answered by the CUDA tower."""
    from tests.unit.test_vision import png_url

    with tiny_model_served(tmp_path, "qwen3_5_vl") as (server, model_dir, paths):
        reload_a_perturbed_step(server, model_dir, paths, seed=5)
        content = [{"type": "image_url", "image_url": {"url": png_url()}}, {"type": "text", "text": "How many?"}]
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": str(model_dir), "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] > 4, reply.text


def transformers_logprobs(model_dir, prompt: list[int], completion: list[int]) -> list[float]:
    """The completion's logprobs under transformers' bf16 forward of `model_dir` (fp32 softmax, temperature 1, as
    vLLM samples). bf16 bounds: two bf16 forwards with different kernels differ by ~1e-2 per logprob."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0].tolist()


PROMPT = [1, 91, 89, 75, 88, 5]
SENDER = """
import sys
from pathlib import Path

import torch

from rl.trainer.transfer import collective_sender
from rl.weights.config import CollectiveTransfer
from tests.integration.test_gpu import perturbed_bf16, sender_world
from tests.unit.test_transfer import SECRET

model_dir, wire_dir, steps = Path(sys.argv[1]), Path(sys.argv[2]), [int(s) for s in sys.argv[3:]]
torch.cuda.set_device(0)
wire = CollectiveTransfer(backend="nccl", secret=SECRET, timeout_s=30, offer_timeout_s=120)
sender = collective_sender(wire, wire_dir, sender_world(), torch.bfloat16, first_step=0)
for step in steps:
    print("sent", step, sender.send_tensors(step, perturbed_bf16(model_dir, seed=step)), flush=True)
sender.close()
"""


def sender_world():
    """The trainer's world as a one-rank sender on cuda:0 sees it."""
    return type("World", (), {"is_main": True, "rank": 0, "world_size": 1, "on_gpu": True,
                              "device": torch.device("cuda", 0), "all_reduce": lambda self, v, op="sum": v})()


def perturbed_bf16(model_dir, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The model's weights moved a little (by `seed`), in bf16 on cuda:0, its tied head included."""
    g = torch.Generator().manual_seed(seed)
    base = load_file(str(model_dir / "model.safetensors"))
    state = {k: (v + 0.05 * v.std() * torch.randn(v.shape, generator=g)).bfloat16().cuda() for k, v in base.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return list(state.items())


def nccl_server(tmp_path, model_dir, hooks):
    """A TP=1 server on GPU 1 that takes steps over NCCL, with test hooks at `hooks`."""
    paths = RunPaths(tmp_path / "run")
    paths.weights_root.mkdir(parents=True)
    return Server(model_dir, paths.weights_root, tmp_path / "inference.log",
                  toml=f'gpu_memory_utilization = 0.4\n[transfer]\nbackend = "nccl"\nsecret = "{SECRET}"\n',
                  env={"CUDA_VISIBLE_DEVICES": "1", "RL_TEST_HOOK_DIR": str(hooks)})


def held_for_forming(log) -> list[str]:
    """The steps whose transfer group the server formed with generation held, from its log."""
    return re.findall(r"step (\d+): generation held [\d.]+ s while the transfer group formed", log.read_text())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the sender on one, the server on another")
def test_over_nccl_steps_arrive_while_a_generate_loop_runs(tmp_path):
    """The first worker receives on a CUDA stream of its own while vLLM generates (CUDA graphs on): a loop of
    requests runs through three steps over NCCL. Every request comes back whole, the group forms once (at step 1,
    generation held for it), and while the later steps arrive over the kept group no request takes much longer than
    one did before any step was sent."""
    from rl.trainer.transfer import collective_sender
    from rl.weights.config import CollectiveTransfer
    from tests.integration.test_inference_tp import send_over_the_wire

    model_dir = build_tiny_model(tmp_path / "model")
    server = nccl_server(tmp_path, model_dir, tmp_path / "hooks")
    torch.cuda.set_device(0)
    wire = CollectiveTransfer(backend="nccl", secret=SECRET, timeout_s=60, offer_timeout_s=120)
    sender = collective_sender(wire, tmp_path / "wire", sender_world(), torch.bfloat16, first_step=0)
    phase, requests, failures, running = ["before"], [], [], threading.Event()

    def generate_loop() -> None:
        body = {"model": str(server.model), "token_ids": PROMPT,
                "sampling_params": {"max_tokens": 32, "min_tokens": 32, "temperature": 1.0}}
        with httpx.Client(timeout=60) as client:
            while running.is_set():
                start, during = time.perf_counter(), phase[0]
                try:
                    reply = client.post(f"{server.url}/inference/v1/generate", json=body)
                    reply.raise_for_status()
                    requests.append((during, time.perf_counter() - start, len(reply.json()["choices"][0]["token_ids"])))
                except Exception as error:  # noqa: BLE001 - the test reports every failure
                    failures.append(repr(error))

    running.set()
    loop = threading.Thread(target=generate_loop, daemon=True)
    loop.start()
    try:
        time.sleep(5)
        for step in (1, 2, 3):
            phase[0] = f"step {step}"
            answer, sent = send_over_the_wire(server, sender, tmp_path / "wire", step, perturbed_bf16(model_dir, step))
            assert answer.status_code == 200, answer.text
            assert answer.json()["weights_checksum"] == sent["weights_checksum"]
        phase[0] = "after"
        time.sleep(2)
    finally:
        running.clear()
        loop.join(60)
        sender.close()
        server.stop()
    assert not failures, failures
    assert requests and all(tokens == 32 for _, _, tokens in requests), requests
    assert held_for_forming(tmp_path / "inference.log") == ["1"]
    before = sorted(seconds for during, seconds, _ in requests if during == "before")
    kept = [seconds for during, seconds, _ in requests if during in ("step 2", "step 3")]
    assert len(before) >= 5 and kept, requests
    bound = max(2.0, 5 * before[len(before) // 2])
    assert max(kept) < bound, (f"a request took {max(kept):.2f} s while a step arrived over the kept group; "
                               f"before any step, the median was {before[len(before) // 2]:.3f} s")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the sender on one, the server on another")
def test_a_trainer_killed_mid_broadcast_leaves_the_server_serving_and_the_next_trainer_forms_a_new_group(tmp_path):
    """NCCL's failure handling: a trainer (a process of its own) sends step 1, then is SIGKILLed while the server's
    first worker waits for step 2's tensors (a test hook holds it after the header). The server answers (step 2 did
    not arrive), still serves step 1 and generates; a new trainer's step 3 forms a new group and loads."""
    from tests.integration.test_inference_tp import take_for, wait_for

    model_dir = build_tiny_model(tmp_path / "model")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    server = nccl_server(tmp_path, model_dir, hooks)
    trainers = []

    def start_trainer(wire_dir, *steps):
        trainers.append(subprocess.Popen([sys.executable, "-c", SENDER, str(model_dir), str(wire_dir),
                                          *map(str, steps)], cwd=ROOT))
        return trainers[-1]

    try:
        first = start_trainer(tmp_path / "wire-1", 1, 2)
        answer = take_for(server, tmp_path / "wire-1", 1)
        assert answer.status_code == 200, answer.text
        step_1 = server.admin("GET", "/policy_step").json()
        (hooks / "during_receive").write_text("")
        reply: dict = {}
        waiter = threading.Thread(target=lambda: reply.update(answer=take_for(server, tmp_path / "wire-1", 2)))
        waiter.start()
        wait_for(hooks / "during_receive.held", timeout_s=120)
        first.kill()  # mid-step: its header went, its tensors had not
        first.wait(30)
        (hooks / "during_receive").unlink()
        waiter.join(180)
        assert not waiter.is_alive(), "the server never answered step 2"
        assert reply["answer"].status_code == 504 and "did not arrive" in reply["answer"].text, reply["answer"].text
        assert server.admin("GET", "/policy_step").json() == step_1
        completion, logprobs = server.generate(PROMPT, max_tokens=8)
        assert len(completion) == 8 and all(lp <= 0 for lp in logprobs)

        start_trainer(tmp_path / "wire-2", 3)
        answer = take_for(server, tmp_path / "wire-2", 3)
        assert answer.status_code == 200, answer.text
        assert server.admin("GET", "/policy_step").json()["step"] == 3
        assert held_for_forming(tmp_path / "inference.log") == ["1", "3"]
    finally:
        for trainer in trainers:
            trainer.kill()
        server.stop()


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
    from rl.trainer.transfer import collective_sender
    from tests.integration.test_inference_tp import send_over_the_wire

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
    world = sender_world()
    torch.cuda.set_device(0)
    wire = CollectiveTransfer(backend="nccl", secret=SECRET, timeout_s=60, offer_timeout_s=120)
    sender = collective_sender(wire, tmp_path / "wire", world, torch.bfloat16, first_step=0)
    try:
        tensors = perturbed_bf16(model_dir, seed=1)
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
        outsider = collective_sender(wire.model_copy(update={"secret": "an outsider's guess"}), tmp_path / "outsider",
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
