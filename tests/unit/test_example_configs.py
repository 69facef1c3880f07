"""The tensor-parallel layouts of configs/ (the verifiers docs' two), as `rl --dry-run` resolves them on a faked
host of 8 GPUs: the GPUs each process gets and the vLLM command line of each inference server."""

import re
import shlex
import tomllib

import pytest

import rl.trainer.config as trainer_config
from rl.inference.config import InferenceConfig
from rl.inference.server import vllm_argv
from rl.launcher import main as launcher
from tests.conftest import ROOT

GPU_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
           "VLLM_WORKER_MULTIPROC_METHOD")
GPU_MEMORY_SHARE = 0.9  # what a server on GPUs reserves (rl.inference.main)


def dry_run(config: str, tmp_path, monkeypatch, capsys) -> str:
    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 8)
    monkeypatch.setattr(trainer_config, "cuda_device_count", lambda: 1)  # a CUDA host
    monkeypatch.setattr(launcher, "check_model", lambda name: None)  # a hub id: nothing is downloaded here
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    launcher.main(["@", str(ROOT / "configs" / config / "rl.toml"), "--output-dir", str(tmp_path / "run"),
                   "--dry-run"])
    return capsys.readouterr().out


def printed_section(out: str, name: str) -> str:
    """The TOML the dry run printed under `# ---- <name> ----`."""
    return out.split(f"# ---- {name} ----\n", 1)[1].split("# ----", 1)[0]


def pairs(argv: list[str]) -> dict[str, str]:
    return {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--")}


@pytest.mark.parametrize("config, model, inference_gpus, trainer_gpus", [
    ("layout_7b_tp4", "Qwen/Qwen2.5-7B-Instruct", "0,1,2,3", "4,5,6,7"),
    ("layout_1.5b_tp2", "Qwen/Qwen2.5-1.5B-Instruct", "0,1", "2,3"),
])
def test_an_example_layout_runs_one_tp_server_beside_the_trainer(config, model, inference_gpus, trainer_gpus,
                                                                 tmp_path, monkeypatch, capsys):
    out = dry_run(config, tmp_path, monkeypatch, capsys)
    commands = {line.split(":", 1)[0]: line for line in printed_section(out, "commands").splitlines()}
    assert set(commands) - {"orchestrator", "trainer"} == {"inference", "env-arithmetic"}  # one server of each
    tp = len(inference_gpus.split(","))
    assert f"CUDA_VISIBLE_DEVICES={inference_gpus} " in commands["inference"]
    assert f"CUDA_VISIBLE_DEVICES={trainer_gpus} " in commands["trainer"]
    assert f"--nproc-per-node={len(trainer_gpus.split(','))}" in commands["trainer"]
    placement = printed_section(out, "placement")
    assert f"inference (1 server on GPUs [{inference_gpus}])" in placement
    assert re.search(r"orchestrator \(to 1 servers\), env-arithmetic \(\d+ workers?\)", placement)  # beside it

    # The server's vLLM command line, from the inference config it is started with.
    served = InferenceConfig.model_validate(tomllib.loads(printed_section(out, "inference config")))
    vllm = pairs(vllm_argv(served, model, GPU_MEMORY_SHARE, []))
    assert (vllm["--model"], vllm["--served-model-name"], vllm["--port"]) == (model, model, "8000")
    assert (vllm["--tensor-parallel-size"], vllm["--dtype"]) == (str(tp), "bfloat16")
    assert "--pipeline-parallel-size" not in vllm and "-tp" not in vllm


def gpu_check_node_run(name: str, tmp_path) -> list[str]:
    """The `rl` arguments of gpu-check.sh's part `name`, as the script runs them on a node of 8 GPUs."""
    script = (ROOT / "scripts" / "gpu-check.sh").read_text().replace("\\\n", " ")
    line = next(line.strip() for line in script.splitlines() if line.strip().startswith(f"part {name} uv run rl "))
    argv = shlex.split(line.removeprefix(f"part {name} uv run rl "))
    return [arg.replace("$node_model", "Qwen/Qwen2.5-1.5B-Instruct").replace("$out", str(tmp_path)) for arg in argv]


@pytest.mark.parametrize("part, servers", [("node-tp2", ["0,1", "2,3"]), ("node-five", ["0", "1", "2", "3"])])
def test_gpu_checks_whole_node_parts_place_every_gpu(part, servers, tmp_path, monkeypatch, capsys):
    """On 8 GPUs: 4 trainer ranks on GPUs 4-7, and the servers on 0-3 (two of TP=2; four of TP=1: with the trainer's
    rank 0, a five-member NCCL group)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 8)
    monkeypatch.setattr(trainer_config, "cuda_device_count", lambda: 1)  # a CUDA host
    monkeypatch.setattr(launcher, "check_model", lambda name: None)
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    launcher.main(gpu_check_node_run(part, tmp_path) + ["--dry-run"])
    commands = printed_section(capsys.readouterr().out, "commands").splitlines()
    inference = [line for line in commands if line.startswith("inference-")]
    assert [re.search(r"CUDA_VISIBLE_DEVICES=(\S+)", line)[1] for line in inference] == servers
    trainer = next(line for line in commands if line.startswith("trainer:"))
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7 " in trainer and "--nproc-per-node=4" in trainer
