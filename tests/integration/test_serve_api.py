"""`rl serve-api` driven by the PyPI Tinker SDK itself, unchanged: a LoRA model trained through forward_backward and
optim_step on rl's FSDP2 trainer (two ranks), sampled and scored on rl's vLLM server after a proved reload."""

import re
import sys
import time
from types import SimpleNamespace

import httpx
import numpy as np
import psutil
import pytest
import tinker

from rl.protocol import RunPaths, read_metrics
from tests.integration.launched import SMALL_KV_CACHE, Launched, free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.integration
KEY = "tml-rl-test-key"
TOKENS = [int(t) for t in np.random.default_rng(0).integers(10, 100, size=24)]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    out, port = tmp_path_factory.mktemp("serve_api") / "run", free_port()
    configs = ROOT / "configs" / "reverse_text"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TINKER_API_KEY", KEY)
        run = Launched([
            sys.executable, "-m", "rl.launcher.main", "serve-api", "--trainer", "@", str(configs / "train.toml"),
            "--inference", "@", str(configs / "infer.toml"), "--model.name", str(tiny_model),
            "--output-dir", str(out), "--seq-len", "128", "--trainer-processes", "2",
            "--inference.port", str(free_port()), "--api.port", str(port), *SMALL_KV_CACHE])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.proc.poll() is None:
        try:
            if httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    else:
        run.stop()
        pytest.fail("rl serve-api never answered:\n" + run.output[-4000:])
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    trainer = client.create_lora_training_client(base_model=str(tiny_model), rank=8)  # one model per service
    clients = [client]
    yield SimpleNamespace(client=client, trainer=trainer, model=str(tiny_model), out=out, url=url, run=run,
                          clients=clients)
    for each in clients:  # before the service stops: else their heartbeats fail on for the rest of the session
        each.close("success").result()
    run.stop()


def datum(loss_fn: str, **extra) -> tinker.Datum:
    inputs = {"target_tokens": TOKENS[1:], **extra}
    if loss_fn == "cross_entropy":
        inputs.setdefault("weights", [1.0] * (len(TOKENS) - 1))
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs=inputs)


def test_the_sdk_trains_a_lora_model_samples_it_and_scores_what_it_sampled(served):
    trainer, model, out = served.trainer, served.model, served.out
    assert trainer.get_info().model_data.model_name == model
    losses = []
    for _ in range(5):  # the loss falls on one fixed datum
        result = trainer.forward_backward([datum("cross_entropy")], "cross_entropy").result()
        losses.append(result.metrics["loss:sum"])
        assert len(result.loss_fn_outputs[0]["logprobs"].tolist()) == len(TOKENS) - 1
        trainer.optim_step(tinker.AdamParams(learning_rate=5e-3)).result()
    assert losses[-1] < losses[0] - 5.0, losses
    scored = trainer.forward([datum("cross_entropy")], "cross_entropy").result()
    learner = scored.loss_fn_outputs[0]["logprobs"].tolist()
    assert -sum(learner) == pytest.approx(scored.metrics["loss:sum"], rel=1e-4)

    sampler = trainer.save_weights_and_get_sampling_client("after-5")
    prompt = tinker.ModelInput.from_ints(TOKENS[:-1])
    sample = sampler.sample(prompt, num_samples=2, sampling_params=tinker.SamplingParams(max_tokens=6)).result()
    assert len(sample.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) > 0 for s in sample.sequences)
    # the sampler serves what the trainer trained: its prompt logprobs are the learner's (float32, both sides)
    prompt_logprobs = sampler.compute_logprobs(tinker.ModelInput.from_ints(TOKENS)).result()
    assert prompt_logprobs[0] is None
    assert np.allclose(prompt_logprobs[1:], learner, atol=1e-4), (prompt_logprobs[1:], learner)
    log = (out / "logs" / "inference.log").read_text()
    assert re.search(r"update to step 5 from \S+/weights/step_5 .*; serving step 5", log), log[-3000:]
    assert "the servers serve policy 5, verified" in (out / "logs" / "service.log").read_text()

    for loss_fn in ("importance_sampling", "ppo", "cispo"):  # the sampler's own logprobs: ratio 1
        sequence = sample.sequences[0]
        tokens = TOKENS[:-1] + list(sequence.tokens)
        rl_datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:],
                            "logprobs": [0.0] * (len(TOKENS) - 2) + list(sequence.logprobs),
                            "advantages": [0.0] * (len(TOKENS) - 2) + [1.0] * len(sequence.tokens)})
        result = trainer.forward_backward([rl_datum], loss_fn).result()
        assert np.isfinite(result.metrics["loss:sum"]), (loss_fn, result.metrics)
    calls = [m["call"] for m in read_metrics(RunPaths(out)) if m.get("process") == "service"]
    assert {"create_model", "forward_backward", "optim_step", "sample"} <= set(calls)


def test_what_rl_does_not_do_is_refused_by_name(served):
    trainer, url = served.trainer, served.url
    with pytest.raises(tinker.TinkerError, match="loss_fn 'dro' is not one rl serve-api computes"):
        trainer.forward_backward([datum("cross_entropy")], "dro").result()
    with pytest.raises(tinker.TinkerError, match=r"target_tokens\[0\] = 7 is not model_input\[1\]"):
        bad = tinker.Datum(model_input=tinker.ModelInput.from_ints([5, 6, 7]),
                           loss_fn_inputs={"target_tokens": [7, 7, 8], "weights": [1.0, 1.0, 1.0]})
        trainer.forward_backward([bad], "cross_entropy").result()
    unknown = httpx.post(f"{url}/api/v1/unload_model", json={"model_id": "x"}, headers={"X-API-Key": KEY})
    assert unknown.status_code == 404 and "does not implement POST /api/v1/unload_model" in unknown.text
    wrong_key = httpx.post(f"{url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-other"})
    assert wrong_key.status_code == 401 and "TINKER_API_KEY" in wrong_key.text
    trainer.forward_backward([datum("cross_entropy")], "cross_entropy").result()
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-4)).result()
    path = trainer.save_weights_for_sampler("refusals").result().path
    sampler = served.client.create_sampling_client(model_path=path)  # a named path, as a recipe keeps them
    assert len(sampler.sample(tinker.ModelInput.from_ints(TOKENS), 1, tinker.SamplingParams(max_tokens=2)).result()
               .sequences) == 1
    base = served.client.create_sampling_client(base_model=served.model)  # policy 0, which the servers left
    with pytest.raises(tinker.TinkerError, match=r"policy 0 is older than policy \d+"):
        base.sample(tinker.ModelInput.from_ints(TOKENS), 1, tinker.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.TinkerError, match="topk_prompt_logprobs"):
        sampler.sample(tinker.ModelInput.from_ints(TOKENS), num_samples=1, sampling_params=tinker.SamplingParams(
            max_tokens=2), include_prompt_logprobs=True, topk_prompt_logprobs=3).result()


def test_the_trainer_killed_mid_call_fails_the_call_and_a_saved_state_resumes_the_model(served):
    trainer = served.trainer
    client = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    served.clients.append(client)
    saved = trainer.save_state("before-kill").result().path
    assert saved.endswith("/weights/before-kill")
    before = trainer.forward([datum("cross_entropy")], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    trainer_pid = served.run.child_pid("trainer")
    long_batch = [datum("cross_entropy")] * 64  # a call that is running when its trainer is killed
    pending = trainer.forward_backward(long_batch, "cross_entropy")
    time.sleep(0.05)
    for process in [psutil.Process(trainer_pid), *psutil.Process(trainer_pid).children(recursive=True)]:
        process.kill()
    start = time.monotonic()
    with pytest.raises(tinker.TinkerError, match="the trainer was restarted"):
        pending.result()
        trainer.forward([datum("cross_entropy")], "cross_entropy").result()  # if the kill came after the call
    assert time.monotonic() - start < 120
    resumed = client.create_training_client_from_state_with_optimizer(saved).result()
    after = resumed.forward([datum("cross_entropy")], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert np.allclose(after, before, atol=1e-5)
    resumed.forward_backward([datum("cross_entropy")], "cross_entropy").result()
    resumed.optim_step(tinker.AdamParams(learning_rate=5e-3)).result()
    # the resumed model's policies take versions no earlier policy had: its sampler serves its own weights
    sampler = resumed.save_weights_and_get_sampling_client("resumed")
    trained = resumed.forward([datum("cross_entropy")], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    served_logprobs = sampler.compute_logprobs(tinker.ModelInput.from_ints(TOKENS)).result()
    assert np.allclose(served_logprobs[1:], trained.tolist(), atol=1e-4)
