"""Device-aware defaults: bf16, activation checkpointing and CUDA graphs where the plan has GPUs, float32 and
eager on CPU, the user's value always kept, and the trainer publishing the dtype inference serves. CUDA is
faked: the resolving functions take the device, and the launcher's view of torch is monkeypatched."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import rl.trainer.config as trainer_config
from rl.config import ConfigError, parse_config
from rl.inference.config import InferenceConfig
from rl.inference.config import resolve_device_defaults as resolve_inference
from rl.inference.server import vllm_argv
from rl.launcher import main as launcher
from rl.launcher.config import RLConfig
from rl.launcher.resolve import resolve
from rl.launcher.devices import DevicePlan, cpu_plan
from rl.launcher.placement import given_host
from rl.trainer.config import TrainerConfig, check_device, vllm_auto_dtype
from rl.trainer.config import resolve_device_defaults as resolve_trainer
from rl.trainer.loss_config import MaskRatio, NoMismatchCorrection, TruncateRatio

GPU_PLAN = DevicePlan(1, [1], [[0]])


def resolved(config: RLConfig, devices: DevicePlan) -> RLConfig:
    return resolve(config, given_host(config, devices))


def model_dir(tmp_path: Path, **config) -> str:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return str(path)


def test_trainer_cpu_defaults_stay_float32_without_checkpointing():
    config = TrainerConfig()
    why = resolve_trainer(config, "cpu")
    assert (config.dtype, config.activation_checkpointing, config.publish_dtype) == ("float32", False, "float32")
    assert config.loss.mismatch == NoMismatchCorrection()
    assert why == {"dtype": "auto: CPU", "activation_checkpointing": "auto: CPU", "loss.mismatch": "auto: CPU",
                   "publish_dtype": "auto: CPU", "transfer.way": "set by you"}


def test_trainer_cuda_defaults_are_bf16_with_checkpointing_and_publish_what_vllm_serves(tmp_path):
    config = TrainerConfig(model={"name": model_dir(tmp_path, dtype="float32")})
    why = resolve_trainer(config, "cuda")
    assert (config.dtype, config.activation_checkpointing, config.publish_dtype) == ("bfloat16", True, "bfloat16")
    assert why["dtype"] == "auto: CUDA" and "config.json: float32" in why["publish_dtype"]
    assert config.loss.mismatch == [MaskRatio()] and why["loss.mismatch"] == "auto: CUDA"  # prime-rl's token mask


def test_trainer_values_set_by_the_user_win_on_cuda(tmp_path):
    config = TrainerConfig(model={"name": model_dir(tmp_path)}, dtype="float32", activation_checkpointing=False,
                           publish_dtype="float16", loss={"mismatch": {"type": "truncate"}})
    why = resolve_trainer(config, "cuda")
    assert (config.dtype, config.activation_checkpointing, config.publish_dtype) == ("float32", False, "float16")
    assert config.loss.mismatch == [TruncateRatio()]  # a single table is a list of one
    assert set(why.values()) == {"set by you"}


def test_a_trainer_started_alone_resolves_for_its_own_device(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_config, "cuda_device_count", lambda: 1)  # a CUDA host
    config = parse_config(TrainerConfig, ["--model.name", model_dir(tmp_path, torch_dtype="bfloat16")])
    check_device(config)
    assert (config.dtype, config.activation_checkpointing, config.publish_dtype) == ("bfloat16", True, "bfloat16")
    assert config.loss.mismatch == [MaskRatio()]
    monkeypatch.setattr(trainer_config, "cuda_device_count", lambda: 0)
    with pytest.raises(ConfigError, match="needs a GPU"):
        check_device(parse_config(TrainerConfig, ["--dtype", "bfloat16"]))
    with pytest.raises(ConfigError, match="flex_attention' needs a GPU"):
        check_device(parse_config(TrainerConfig, ["--attn-implementation", "flex_attention"]))


@pytest.mark.gpu
def test_on_a_real_cuda_host_the_trainer_masks_the_mismatch_and_computes_in_bf16(tmp_path):
    config = parse_config(TrainerConfig, ["--model.name", model_dir(tmp_path, torch_dtype="bfloat16")])
    check_device(config)
    assert config.loss.mismatch == [MaskRatio()] and config.dtype == "bfloat16"


def test_inference_defaults_by_device_and_the_users_values_win():
    cpu, cuda = InferenceConfig(), InferenceConfig()
    assert resolve_inference(cpu, "cpu") == dict.fromkeys(["dtype", "enforce_eager", "log_stats"], "auto: CPU") | {
        "transfer.way": "set by you"}
    assert (cpu.dtype, cpu.enforce_eager, cpu.log_stats) == ("float32", True, False)
    resolve_inference(cuda, "cuda")
    assert (cuda.dtype, cuda.enforce_eager, cuda.log_stats) == ("auto", False, True)
    mine = InferenceConfig(dtype="float32", enforce_eager=True, log_stats=True)
    assert resolve_inference(mine, "cpu") == {"dtype": "set by you", "enforce_eager": "set by you",
                                              "log_stats": "set by you", "transfer.way": "set by you"}
    assert (mine.dtype, mine.enforce_eager, mine.log_stats) == ("float32", True, True)
    assert "--disable-log-stats" in vllm_argv(cpu, "/m", 0.2, []) and "--disable-log-stats" not in vllm_argv(
        cuda, "/m", 0.9, []) + vllm_argv(mine, "/m", 0.2, [])


@pytest.mark.parametrize("config, served", [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),
    ({"torch_dtype": "float32"}, "bfloat16"),
    ({"dtype": "torch.float16"}, "float16"),
    ({"text_config": {"dtype": "float16"}}, "float16"),
    ({"model_type": "gemma2", "torch_dtype": "float16"}, "bfloat16"),
    ({}, "bfloat16"),
])
def test_vllm_auto_dtype_from_config_json(tmp_path, config, served):
    assert vllm_auto_dtype(model_dir(tmp_path, **config))[0] == served


def test_vllm_auto_dtype_reads_the_weights_when_config_json_names_none(tmp_path):
    path = model_dir(tmp_path)
    save_file({"w": torch.zeros(2, dtype=torch.float16)}, f"{path}/model.safetensors")
    assert vllm_auto_dtype(path) == ("float16", "safetensors weights: float16")
    save_file({"v": torch.zeros(2, dtype=torch.bfloat16)}, f"{path}/model-2.safetensors")
    assert vllm_auto_dtype(path)[0] == "bfloat16"  # fp16 with bf16 promotes to fp32, served as bf16


def test_the_mirror_agrees_with_vllms_own_rule(tmp_path):
    """vLLM's `_resolve_auto_dtype` on this CPU (x86: bf16, fp16 and fp32, as CUDA from Ampere on)."""
    from vllm.config.model import _resolve_auto_dtype  # a slow import: one test compares every case

    for model_type in ("qwen3", "gemma2", "glm4"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            name = str(dtype).removeprefix("torch.")
            model = model_dir(tmp_path, model_type=model_type, dtype=name)
            expected = _resolve_auto_dtype(model_type, dtype, is_pooling_model=False)
            assert vllm_auto_dtype(model)[0] == str(expected).removeprefix("torch."), (model_type, name)


def test_launcher_fills_both_processes_for_a_gpu_plan(tmp_path):
    config = parse_config(RLConfig, ["--model.name", model_dir(tmp_path, torch_dtype="bfloat16")])
    r = resolved(config, GPU_PLAN)
    trainer = (r.trainer.dtype, r.trainer.activation_checkpointing, r.trainer.publish_dtype)
    assert trainer == ("bfloat16", True, "bfloat16")
    assert (r.inference.dtype, r.inference.enforce_eager) == ("auto", False)
    assert r.device_choices["trainer.dtype"] == "auto: CUDA"
    assert r.device_choices["trainer.publish_dtype"] == "what vLLM's --dtype auto serves: config.json: bfloat16"
    assert r.device_choices["inference.enforce_eager"] == "auto: CUDA"
    assert r.trainer.loss.mismatch == [MaskRatio()]
    assert r.device_choices["trainer.loss.mismatch"] == "auto: CUDA"


def test_launcher_keeps_cpu_defaults_for_a_cpu_plan():
    r = resolved(parse_config(RLConfig, []), cpu_plan(1, 1))
    trainer = (r.trainer.dtype, r.trainer.activation_checkpointing, r.trainer.publish_dtype)
    assert trainer == ("float32", False, "float32")
    assert (r.inference.dtype, r.inference.enforce_eager) == ("float32", True)
    assert r.trainer.loss.mismatch == NoMismatchCorrection()
    assert r.device_choices["trainer.loss.mismatch"] == "auto: CPU"


def test_adaptive_concurrency_turns_the_servers_statistics_on_on_cpu_unless_the_user_turned_them_off():
    r = resolved(parse_config(RLConfig, ["--orchestrator.concurrency.adaptive", "true"]), cpu_plan(1, 1))
    assert r.inference.log_stats is True
    assert r._device_choices["inference.log_stats"] == "on: orchestrator.concurrency.adaptive reads them"
    with pytest.raises(ConfigError, match="log_stats = false"):
        resolved(parse_config(RLConfig, ["--orchestrator.concurrency.adaptive", "true", "--inference.log-stats",
                                         "false"]), cpu_plan(1, 1))


def test_weights_over_nccl_need_a_gpu_plan_and_cpu_plans_are_told_to_use_gloo(tmp_path):
    model = model_dir(tmp_path, torch_dtype="bfloat16")
    r = resolved(parse_config(RLConfig, ["--model.name", model, "--transfer.backend", "nccl"]), GPU_PLAN)
    assert r.trainer.transfer.way == r.inference.transfer.way == r.orchestrator.transfer.way == "nccl"
    with pytest.raises(ConfigError, match="'nccl' needs CUDA GPUs, but the inference runs on cpu: use 'gloo'"):
        resolved(parse_config(RLConfig, ["--transfer.backend", "nccl"]), cpu_plan(1, 1))


@pytest.mark.parametrize("asked, sparse", [(("--transfer.type", "collective"), False),
                                           (("--transfer.sparse", "true"), True)])
def test_a_backend_left_to_the_device_is_nccl_on_gpus_and_gloo_on_cpus(tmp_path, asked, sparse):
    model = model_dir(tmp_path, torch_dtype="bfloat16")
    for plan, chosen, why in ((GPU_PLAN, "nccl", "auto: CUDA"), (cpu_plan(1, 1), "gloo", "auto: CPU")):
        r = resolved(parse_config(RLConfig, ["--model.name", model, *asked]), plan)
        sections = (r.trainer.transfer, r.inference.transfer, r.orchestrator.transfer)
        assert {(s.type, s.way, s.sparse) for s in sections} == {("collective", chosen, sparse)}
        assert r.device_choices["trainer.transfer.way"] == r.device_choices["inference.transfer.way"] == why
    r = resolved(parse_config(RLConfig, ["--model.name", model, "--transfer.backend", "gloo"]), cpu_plan(1, 1))
    assert r.device_choices["trainer.transfer.way"] == "set by you"


def test_an_explicit_inference_dtype_sets_the_publish_dtype_and_a_conflict_names_both(tmp_path):
    model = model_dir(tmp_path, torch_dtype="bfloat16")
    r = resolved(parse_config(RLConfig, ["--model.name", model, "--inference.dtype", "float16"]), GPU_PLAN)
    assert r.trainer.publish_dtype == "float16" and r.trainer.dtype == "bfloat16"
    assert r.device_choices["trainer.publish_dtype"] == "as inference.dtype"
    r = resolved(parse_config(RLConfig, ["--model.name", model, "--inference.dtype", "float32",
                                        "--trainer.dtype", "float32"]), GPU_PLAN)
    assert (r.trainer.dtype, r.trainer.publish_dtype, r.inference.dtype) == ("float32", "float32", "float32")
    conflict = parse_config(RLConfig, ["--model.name", model, "--inference.dtype", "float16",
                                       "--trainer.publish-dtype", "bfloat16"])
    with pytest.raises(ConfigError, match="trainer.publish_dtype = 'bfloat16' but inference.dtype = 'float16'"):
        resolved(conflict, GPU_PLAN)


def test_an_unreadable_model_config_asks_for_an_explicit_dtype(tmp_path):
    config = parse_config(RLConfig, ["--model.name", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="--inference.dtype"):
        resolved(config, GPU_PLAN)


def test_dry_run_prints_what_the_device_chose_and_the_mapped_gpus(tmp_path, monkeypatch, capsys):
    """Faked CUDA host whose launcher was given GPUs 4,5: inference gets index 0 (GPU 4), the trainer 1 (GPU 5)."""
    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(trainer_config, "cuda_device_count", lambda: 1)  # a CUDA host
    for name in ("CUDA_DEVICE_ORDER", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    launcher.main(["--model.name", model_dir(tmp_path, torch_dtype="bfloat16"), "--output-dir",
                   str(tmp_path / "run"), "--trainer-gpus", "1", "--inference-gpus", "1", "--dry-run"])
    out = capsys.readouterr().out
    assert "trainer.dtype = bfloat16 (auto: CUDA)" in out
    assert "trainer.activation_checkpointing = true (auto: CUDA)" in out
    assert 'trainer.loss.mismatch = [{ type = "mask", max_log_ratio = 1.0, against = "sampled" }] (auto: CUDA)' in out
    assert "inference.dtype = auto (auto: CUDA)" in out and "inference.enforce_eager = false (auto: CUDA)" in out
    assert "inference.log_stats = true (auto: CUDA)" in out
    commands = {line.split(":", 1)[0]: line for line in out.splitlines() if line.startswith(("inference:", "trainer:"))}
    assert "CUDA_VISIBLE_DEVICES=4 " in commands["inference"]
    assert "VLLM_WORKER_MULTIPROC_METHOD=spawn" in commands["inference"]
    assert "CUDA_VISIBLE_DEVICES=5 " in commands["trainer"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in commands["trainer"]
    assert " -m torch.distributed.run " in commands["trainer"]  # on GPUs each rank is a fresh process, not a fork
    assert all("CUDA_DEVICE_ORDER=PCI_BUS_ID" in line for line in commands.values())
