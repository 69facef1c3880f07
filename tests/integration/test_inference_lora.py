"""The inference server serving a LoRA adapter over the tiny model, with tensor parallelism (two workers, each
holding its shard of every LoRA slot): adapter steps replace it in place through /update_weights, verified on
every worker; outputs equal Hugging Face's with the merged weights W + (alpha / r) B A; bad adapters (non-finite,
out-of-range alpha) are refused and the previous one keeps serving; vLLM loads the server's private copy of what
it checked, never the step's own files; vLLM's own adapter routes stay refused."""

import os
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from rl.adapter import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, DEFAULT_TARGETS, adapter_checksum, adapter_config_bytes,
                        tensor_name)
from rl.manifest import mark_stable
from tests.integration.inference_server import Server, model_and_weights_dir
from tests.integration.test_inference import PROMPTS, TOLERANCE, hf_logprobs

pytestmark = pytest.mark.integration
NAME, RANK, ALPHA = "policy-lora", 8, 16


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return model_and_weights_dir(tmp_path_factory, "inference-lora")


@pytest.fixture(scope="module")
def server(run_dir):
    (run_dir / "hooks").mkdir()
    server = Server(run_dir / "model", run_dir / "weights", run_dir / "inference.log",
                    toml=f'tensor_parallel_size = 2\n[lora]\nname = "{NAME}"\nmax_rank = {RANK}\n',
                    env={"RL_TEST_HOOK_DIR": str(run_dir / "hooks")})
    yield server
    server.stop()


def projections(model_dir) -> dict[str, tuple[int, int]]:
    """Module -> (out, in) of every attention and MLP projection of the model."""
    state = load_file(model_dir / "model.safetensors")
    return {name.removesuffix(".weight"): tuple(w.shape) for name, w in state.items()
            if name.endswith(".weight") and name.split(".")[-2] in DEFAULT_TARGETS}


def random_adapter(model_dir, seed: int, zero_b: bool = False) -> dict[str, torch.Tensor]:
    """A rank-RANK adapter on every projection, PEFT tensor names: A ~ N(0, 1/in), B ~ N(0, 0.1^2) (or B = 0)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out, inp) in sorted(projections(model_dir).items()):
        tensors[tensor_name(module, "A")] = torch.randn(RANK, inp, generator=g) / inp**0.5
        b = torch.zeros(out, RANK) if zero_b else 0.1 * torch.randn(out, RANK, generator=g)
        tensors[tensor_name(module, "B")] = b
    return tensors


def publish_adapter(run_dir, step: int, tensors: dict[str, torch.Tensor], alpha: float = ALPHA):
    """weights/step_k as the trainer publishes an adapter: adapter_model.safetensors, adapter_config.json, STABLE."""
    out = run_dir / "weights" / f"step_{step}"
    out.mkdir()
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_bytes(adapter_config_bytes(str(run_dir / "model"), RANK, alpha, 0.0, DEFAULT_TARGETS))
    mark_stable(out, step=step)
    return out


def merged_model(run_dir, name: str, tensors: dict[str, torch.Tensor]):
    """A copy of the model with the adapter merged: W + (alpha / r) B A, computed in float64."""
    out = run_dir / name
    shutil.copytree(run_dir / "model", out)
    state = load_file(out / "model.safetensors")
    for module in projections(run_dir / "model"):
        a, b = tensors[tensor_name(module, "A")].double(), tensors[tensor_name(module, "B")].double()
        weight = f"{module}.weight"
        state[weight] = (state[weight].double() + ALPHA / RANK * b @ a).to(state[weight].dtype)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def served_logprobs(server, model: str) -> list[tuple[list[int], list[float]]]:
    return [server.generate(prompt, max_tokens=12, seed=seed, model=model) for seed, prompt in enumerate(PROMPTS)]


def max_mismatch(server, model: str, model_dir) -> float:
    """Largest |served - Hugging Face| logprob over seeded completions of PROMPTS from `model` (a name)."""
    worst = 0.0
    for prompt, (completion, logprobs) in zip(PROMPTS, served_logprobs(server, model), strict=True):
        worst = max(worst, (torch.tensor(logprobs) - hf_logprobs(model_dir, prompt, completion)).abs().max().item())
    print(f"max |vLLM({model}) - HF({model_dir.name})| logprob = {worst:.2e}")
    return worst


def update(server, step: int, path):
    return server.admin("POST", "/update_weights", json={"step": step, "path": str(path)})


def test_adapter_steps_serve_the_merged_weights(server, run_dir):
    """Step 0's adapter (B = 0) serves the base model's logprobs; a random adapter serves those of the merged
    weights and not the base model's; the next step's adapter replaces it."""
    assert server.admin("GET", "/policy_step").json() | {"weights_checksum": None, "instance": None} == {
        "step": 0, "weights_checksum": None, "requests_in_flight": 0, "instance": None}  # the base model, no adapter
    assert max_mismatch(server, str(run_dir / "model"), run_dir / "model") < TOLERANCE

    zero = random_adapter(run_dir / "model", seed=0, zero_b=True)
    response = update(server, 0, publish_adapter(run_dir, 0, zero))
    assert response.status_code == 200, response.text
    assert response.json()["weights_checksum"] == adapter_checksum(zero.items())
    assert server.admin("GET", "/policy_step").json()["adapter"] == NAME
    assert served_logprobs(server, NAME) == served_logprobs(server, str(run_dir / "model"))
    assert max_mismatch(server, NAME, run_dir / "model") < TOLERANCE
    retried = update(server, 0, run_dir / "weights" / "step_0")
    assert retried.status_code == 200 and "reload_s" not in retried.json()  # answered without reloading

    first = random_adapter(run_dir / "model", seed=1)
    response = update(server, 1, publish_adapter(run_dir, 1, first))
    assert response.status_code == 200, response.text
    print("rank-8 adapter update:", {k: v for k, v in response.json().items() if k != "weights_checksum"})
    assert response.json()["bytes_read"] == (run_dir / "weights" / "step_1" / ADAPTER_WEIGHTS).stat().st_size
    served = server.admin("GET", "/policy_step").json()
    assert served["step"] == 1 and served["weights_checksum"] == adapter_checksum(first.items())
    assert max_mismatch(server, NAME, merged_model(run_dir, "merged_1", first)) < TOLERANCE
    assert max_mismatch(server, NAME, run_dir / "model") > 100 * TOLERANCE  # the adapter really acts
    assert max_mismatch(server, str(run_dir / "model"), run_dir / "model") < TOLERANCE  # the base stays servable

    second = random_adapter(run_dir / "model", seed=2)
    assert update(server, 2, publish_adapter(run_dir, 2, second)).status_code == 200
    assert max_mismatch(server, NAME, merged_model(run_dir, "merged_2", second)) < TOLERANCE
    assert max_mismatch(server, NAME, run_dir / "merged_1") > 100 * TOLERANCE


def test_bad_steps_are_refused_and_the_adapter_keeps_serving(server, run_dir):
    step = server.admin("GET", "/policy_step").json()["step"]
    before = server.admin("GET", "/policy_step").json()
    outputs = served_logprobs(server, NAME)

    corrupt = publish_adapter(run_dir, step + 1, random_adapter(run_dir / "model", seed=3))
    data = bytearray((corrupt / ADAPTER_WEIGHTS).read_bytes())
    data[-5] ^= 0x01  # still valid safetensors
    (corrupt / ADAPTER_WEIGHTS).write_bytes(bytes(data))
    response = update(server, step + 1, corrupt)
    assert response.status_code == 422 and "CRC-32" in response.text, response.text

    q_only = {name: t for name, t in random_adapter(run_dir / "model", seed=4).items() if ".q_proj." in name}
    nowhere = {name.replace("q_proj", "no_such_proj"): t for name, t in q_only.items()}
    response = update(server, step + 2, publish_adapter(run_dir, step + 2, nowhere))
    assert response.status_code == 400 and "maps to no LoRA layer" in response.text, response.text

    full = run_dir / "weights" / f"step_{step + 3}"
    shutil.copytree(run_dir / "model", full)
    mark_stable(full)
    response = update(server, step + 3, full)
    assert response.status_code == 400 and "full weights" in response.text, response.text

    assert server.admin("GET", "/policy_step").json() == before
    assert served_logprobs(server, NAME) == outputs


@pytest.mark.parametrize("route", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_vllms_adapter_routes_are_refused(server, run_dir, route):
    step_dir = run_dir / "weights" / "step_1"
    response = server.admin("POST", route, json={"lora_name": "other", "lora_path": str(step_dir)})
    assert response.status_code == 403 and "not served" in response.text
    assert server.admin("GET", "/policy_step").json()["adapter"] == NAME


def test_requests_do_not_reload_the_adapter_from_disk(server, run_dir):
    """vLLM keeps the registry's request on every generation request; had it kept `load_inplace`, each scheduler
    step would load the adapter from its directory again. Changing the served step's files on disk (which never
    happens to a published step) must not change what is served."""
    served = server.admin("GET", "/policy_step").json()
    outputs = served_logprobs(server, NAME)
    other = random_adapter(run_dir / "model", seed=9)
    save_file(other, run_dir / "weights" / f"step_{served['step']}" / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    assert served_logprobs(server, NAME) == outputs


def finite_outputs(server, model: str) -> list[tuple[list[int], list[float]]]:
    outputs = served_logprobs(server, model)
    assert all(torch.isfinite(torch.tensor(logprobs)).all() for _, logprobs in outputs), outputs
    return outputs


def test_non_finite_tensors_and_an_out_of_range_alpha_are_refused_and_outputs_stay_finite(server, run_dir):
    """An adapter with inf in one lora_A passed round 2 (inf == inf in the read-back) and made every later request
    answer NaN logprobs, the base model's too; lora_alpha 1e30 made the adapter answer empty text."""
    step = server.admin("GET", "/policy_step").json()["step"]
    before = server.admin("GET", "/policy_step").json()
    base, adapter = finite_outputs(server, str(run_dir / "model")), finite_outputs(server, NAME)

    poisoned = random_adapter(run_dir / "model", seed=5)
    name = next(n for n in poisoned if n.endswith("o_proj.lora_A.weight"))
    poisoned[name][0, 3] = float("inf")
    response = update(server, step + 11, publish_adapter(run_dir, step + 11, poisoned))
    assert response.status_code == 400 and f"{name}: holds values that are not finite" in response.text, response.text

    response = update(server, step + 12, publish_adapter(run_dir, step + 12, random_adapter(run_dir / "model", 6),
                                                        alpha=1e30))
    assert response.status_code == 400 and "lora_alpha / r" in response.text, response.text

    assert server.admin("GET", "/policy_step").json() == before
    assert finite_outputs(server, str(run_dir / "model")) == base and finite_outputs(server, NAME) == adapter


def test_vllm_loads_the_adapter_bytes_rl_checked_not_the_steps_path(server, run_dir):
    """Round 2's race: vLLM's add_lora opened the adapter again by path after rl's checked read, so a FIFO renamed
    over adapter_config.json held the update and all generation for 55 s. The update holds (a test hook) after
    the server read and checked the step's files; the FIFO goes in then; vLLM loads the server's private copy."""
    step = server.admin("GET", "/policy_step").json()["step"] + 20  # above the steps the tests before refused
    tensors = random_adapter(run_dir / "model", seed=7)
    directory = publish_adapter(run_dir, step, tensors)
    (run_dir / "hooks" / "after_stage").touch()
    reply: dict = {}
    waiter = threading.Thread(target=lambda: reply.update(answer=update(server, step, directory)))
    waiter.start()
    deadline = time.monotonic() + 60
    while not (run_dir / "hooks" / "after_stage.held").exists():
        assert time.monotonic() < deadline, "the update did not reach its hold"
        time.sleep(0.02)
    os.mkfifo(run_dir / "fifo")
    os.rename(run_dir / "fifo", directory / ADAPTER_CONFIG)
    (run_dir / "hooks" / "after_stage.held").unlink()
    released = time.monotonic()
    (run_dir / "hooks" / "after_stage").unlink()
    waiter.join(120)
    answer = reply["answer"]
    assert answer.status_code == 200, answer.text
    assert time.monotonic() - released < 20  # not held by the FIFO
    assert answer.json()["weights_checksum"] == adapter_checksum(tensors.items())
    finite_outputs(server, NAME)  # generation goes on
