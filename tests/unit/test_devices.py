import json
import sys

import pytest
import torch

from rl.config import ConfigError, parse_config
from rl.inference.config import CPU_BIND
from rl.launcher import main as launcher
from rl.launcher.config import RLConfig
from rl.launcher.devices import DevicePlan, child_visible_devices, nvidia_gpus_present, split_gpus
from rl.launcher.placement import given_host
from rl.protocol import RunPaths


def test_counts_give_inference_the_first_gpus():
    plan = split_gpus(8, trainer_gpus=4, inference_gpus=4)
    assert plan.inference_gpus == [[0], [1], [2], [3]]
    assert plan.trainer_gpus == [4, 5, 6, 7] and plan.trainer_processes == 4


def test_tensor_parallel_servers_take_consecutive_gpus_and_a_share_that_does_not_divide_is_refused():
    plan = split_gpus(8, trainer_gpus=4, inference_gpus=4, tensor_parallel_size=2)
    assert plan.inference_gpus == [[0, 1], [2, 3]] and plan.trainer_gpus == [4, 5, 6, 7]
    plan = split_gpus(8, trainer_gpu_ids=[0, 1], inference_gpu_ids=[2, 3, 6, 7], tensor_parallel_size=2)
    assert plan.inference_gpus == [[2, 3], [6, 7]]
    with pytest.raises(ConfigError, match=r"3 inference GPUs \[0, 1, 2\] do not divide into servers of "
                                          r"inference.tensor_parallel_size = 2 GPUs each: .*--inference-gpus"):
        split_gpus(8, trainer_gpus=4, inference_gpus=3, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"2 inference GPUs \[5, 6\] do not divide .* = 4 GPUs each"):
        split_gpus(8, trainer_gpu_ids=[0], inference_gpu_ids=[5, 6], tensor_parallel_size=4)


def test_tensor_parallel_size_is_a_field_and_vllms_own_parallel_flags_are_refused():
    from rl.inference.server import vllm_argv

    config = parse_config(RLConfig, ["--inference.tensor-parallel-size", "4", "--inference.dtype", "bfloat16"])
    argv = vllm_argv(config.inference, "/m", 0.9, [])
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        parse_config(RLConfig, ["--inference.tensor-parallel-size", "0"])
    for given in (["-tp", "2"], ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["-tp=2"],
                  ["--tensor_parallel_size", "2"], ["--tensor-p", "2"]):
        flag = given[0]
        with pytest.raises(ConfigError, match=f"{flag} duplicates inference.tensor_parallel_size: set that field"):
            parse_config(RLConfig, ["--inference.extra-args", json.dumps(["--max-num-seqs", "8", *given])])
    for given in ("-pp", "--pipeline-parallel-size=2", "--pipeline_parallel"):
        with pytest.raises(ConfigError, match=f"{given}: pipeline parallelism is not supported"):
            parse_config(RLConfig, ["--inference.extra-args", json.dumps([given, "2"])])
    kept = ["--max-num-seqs", "8", "--tokenizer", "t", "--port", "1"]  # short prefixes of other flags pass
    assert parse_config(RLConfig, ["--inference.extra-args", json.dumps(kept)]).inference.extra_args == kept


def test_cpu_servers_bind_each_tp_worker_to_a_core_of_their_own(monkeypatch):
    monkeypatch.delenv(CPU_BIND, raising=False)
    assert launcher.cpu_server_env(0, 1, [0, 1]) == {}  # one worker: as before TP
    assert [launcher.cpu_server_env(i, 2, [0, 1, 2, 3]) for i in range(3)] == [
        {CPU_BIND: "0|1"}, {CPU_BIND: "2|3"}, {CPU_BIND: "0|1"}]  # shared once past 4
    assert launcher.cpu_server_env(1, 2, [4, 5, 7]) == {CPU_BIND: "7|4"}  # the cores this process may use
    with pytest.raises(ConfigError, match=r"tensor_parallel_size = 4 needs 4 CPU cores per server .* may use 2: "
                                          r"set inference.tensor_parallel_size to at most 2"):
        launcher.cpu_server_env(0, 4, [0, 1])
    monkeypatch.setenv(CPU_BIND, "0-1|2-3")
    assert launcher.cpu_server_env(0, 4, [0, 1]) == {}  # the user's binding is kept


def test_a_cpu_host_with_fewer_cores_than_tp_workers_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(CPU_BIND, raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(launcher.Supervisor, "run", lambda *a: pytest.fail("a process was started"))
    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen3"}')
    argv = ["--model.name", str(tmp_path / "model"), "--output-dir", str(tmp_path / "run"), "--inference-replicas", "2"]
    launcher.main(argv + ["--inference.tensor-parallel-size", "2", "--dry-run"])
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("inference-")]
    assert [line.split(" ", 1)[1].split(" ", 1)[0] for line in commands] == [
        f"{CPU_BIND}='0|1'", f"{CPU_BIND}='0|1'"]  # quoted as a shell would need
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(argv + ["--inference.tensor-parallel-size", "3"])
    assert exit_info.value.code == 2
    assert "may use 2: set inference.tensor_parallel_size to at most 2" in capsys.readouterr().err


def test_explicit_ids():
    plan = split_gpus(4, trainer_gpu_ids=[0, 2], inference_gpu_ids=[1, 3])
    assert plan.trainer_gpus == [0, 2] and plan.inference_gpus == [[1], [3]]


def test_one_count_takes_the_rest():
    plan = split_gpus(4, inference_gpus=1)
    assert plan.inference_gpus == [[0]] and plan.trainer_gpus == [1, 2, 3]
    plan = split_gpus(8, trainer_gpus=6)  # inference gets the other 2, none idle (it got 1 of them)
    assert plan.inference_gpus == [[0], [1]] and plan.trainer_gpus == [2, 3, 4, 5, 6, 7]
    plan = split_gpus(8, trainer_gpu_ids=[4, 5, 6, 7], tensor_parallel_size=2)
    assert plan.inference_gpus == [[0, 1], [2, 3]] and plan.trainer_gpus == [4, 5, 6, 7]
    plan = split_gpus(8)
    assert plan.inference_gpus == [[0], [1], [2], [3]] and plan.trainer_gpus == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(trainer_gpus=4, inference_gpus=8), "only 8 are visible"),
        (dict(trainer_gpu_ids=[0, 9], inference_gpu_ids=[1]), "do not exist"),
        (dict(trainer_gpu_ids=[0, 1], inference_gpu_ids=[1]), "overlap"),
        (dict(trainer_gpu_ids=[0, 0], inference_gpu_ids=[1]), "twice"),
        (dict(trainer_gpus=8, inference_gpus=0), "at least one GPU"),
    ],
)
def test_impossible_splits_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        split_gpus(8, **kwargs)


def test_gpu_ids_map_through_the_launchers_visible_devices():
    assert child_visible_devices([0, 1], None) == ["0", "1"]
    assert child_visible_devices([0], "4,5") == ["4"] and child_visible_devices([1], "4,5") == ["5"]
    assert child_visible_devices([1], "GPU-aaa, GPU-bbb") == ["GPU-bbb"]
    with pytest.raises(ConfigError, match="beyond this process's CUDA_VISIBLE_DEVICES='4,5'"):
        child_visible_devices([2], "4,5")


GPU_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
           "VLLM_WORKER_MULTIPROC_METHOD")


def gpu_children(tmp_path, monkeypatch, **env) -> dict:
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config, _ = launcher.load(["--output-dir", str(tmp_path)])
    host = given_host(config, DevicePlan(1, [1], [[0]]))
    return {spec.name: spec.extra_env for spec in launcher.child_specs(config, host, RunPaths(tmp_path))}


def test_children_of_a_launcher_given_gpus_4_and_5_get_gpus_4_and_5(tmp_path, monkeypatch):
    envs = gpu_children(tmp_path, monkeypatch, CUDA_VISIBLE_DEVICES="4,5")
    assert envs["inference"] == {"CUDA_VISIBLE_DEVICES": "4", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                 "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert envs["trainer"] == {"CUDA_VISIBLE_DEVICES": "5", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert envs["orchestrator"] == {"CUDA_VISIBLE_DEVICES": ""}


def test_gpu_settings_the_user_exported_are_kept(tmp_path, monkeypatch):
    envs = gpu_children(tmp_path, monkeypatch, CUDA_DEVICE_ORDER="FASTEST_FIRST", PYTORCH_ALLOC_CONF="x:1",
                        VLLM_WORKER_MULTIPROC_METHOD="fork")
    assert envs["inference"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert envs["trainer"] == {"CUDA_VISIBLE_DEVICES": "1"}


def test_a_gpu_host_is_seen_without_torch(tmp_path):
    proc = tmp_path / "gpus"
    proc.mkdir()
    fails = (sys.executable, "-c", "raise SystemExit(9)")
    assert nvidia_gpus_present(proc, fails) is None
    assert nvidia_gpus_present(proc, ("/nonexistent/nvidia-smi", "-L")) is None
    lists_two = (sys.executable, "-c",
                 "print('GPU 0: NVIDIA H100 (UUID: GPU-a)'); print('GPU 1: NVIDIA H100 (UUID: GPU-b)')")
    assert nvidia_gpus_present(proc, lists_two) == f"`{' '.join(lists_two)}` lists 2"
    assert nvidia_gpus_present(proc, (sys.executable, "-c", "import time; time.sleep(30)"), timeout_s=0.5) is None
    (proc / "0000:17:00.0").mkdir()
    assert nvidia_gpus_present(proc, fails) == f"{proc} lists 1"


@pytest.fixture
def gpu_host_with_cpu_torch(monkeypatch):
    monkeypatch.setattr(launcher, "nvidia_gpus_present", lambda: "`nvidia-smi -L` lists 8")
    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_gpu_host_whose_torch_sees_no_gpu_is_refused_naming_torch_and_the_fix(gpu_host_with_cpu_torch):
    with pytest.raises(ConfigError) as error:
        launcher.plan_devices(parse_config(RLConfig, []), launcher.cuda_device_count())
    message = str(error.value)
    assert "`nvidia-smi -L` lists 8" in message and f"torch {torch.__version__} (a CPU-only build)" in message
    assert "RL_STACK=gpu bash scripts/install.sh" in message and "uv sync --extra gpu" in message


def test_gpus_hidden_on_purpose_or_a_cluster_job_plan_a_cpu_run(gpu_host_with_cpu_torch, monkeypatch):
    assert launcher.plan_devices(parse_config(RLConfig, ["--k8s"]), 0).device == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launcher.plan_devices(parse_config(RLConfig, []), 0).device == "cpu"


def test_gpu_flags_with_a_cpu_torch_name_the_build_and_the_fix(gpu_host_with_cpu_torch):
    fix = r"no GPU is visible to the installed torch .*RL_STACK=gpu bash scripts/install.sh"
    with pytest.raises(ConfigError, match=fix):
        launcher.plan_devices(parse_config(RLConfig, ["--trainer-gpu-ids", "[0]"]), 0)


def test_rl_stops_before_starting_anything(gpu_host_with_cpu_torch, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(launcher.Supervisor, "run", lambda *a: pytest.fail("a process was started"))
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["--output-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("rl: error: this host has NVIDIA GPUs")


def test_the_launcher_checks_a_run_without_torch_on_a_host_without_gpus():
    """torch's import costs 4-5 s of a core on a small CPU host, and the launcher needs none of it there (nor does
    an env server's set-up, which the launcher's environment check shares)."""
    import subprocess
    from pathlib import Path

    from rl.trainer.config import GPU_DEVICE_NODES

    if any(any(Path("/dev").glob(node)) for node in GPU_DEVICE_NODES):
        pytest.skip("this host has a GPU device node: the launcher asks torch")
    code = ("import sys; from rl.launcher.main import cuda_device_count; "
            "import rl.envs.server as e; e.set_up_worker(); "
            "print(cuda_device_count(), sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "0 []", done.stdout[-2000:]
