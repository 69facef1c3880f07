"""Runs over several hosts, without starting them: roles and per-host settings from the command line, the
host board in the shared run directory, and the SLURM job and Kubernetes manifests `rl` renders (the
manifests checked against Kubernetes' own schemas)."""

import json
import re
import shlex
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

from rl.config import ConfigError, parse_config
from rl.launcher.config import RLConfig
from rl.launcher.deploy import as_given, render_k8s, render_slurm, slurm_job
from rl.launcher.hosts import Host, HostBoard
from rl.launcher.main import child_specs, load
from rl.protocol import RunPaths, atomic_write_text
from tests.conftest import ROOT

CONFIGS = ROOT / "configs" / "reverse_text"
FILES = ["--trainer", "@", str(CONFIGS / "train.toml"), "--orchestrator", "@", str(CONFIGS / "orch.toml"),
         "--inference", "@", str(CONFIGS / "infer.toml")]


def commands(argv: list[str], tmp_path) -> dict[str, list[str]]:
    config, host = load(FILES + ["--output-dir", str(tmp_path / "run")] + argv)
    return {spec.name: spec.cmd for spec in child_specs(config, host, RunPaths(tmp_path / "run"))}


def test_each_host_starts_only_its_roles(tmp_path):
    token = ["--inference.admin-token", "t0ken"]
    host_a = commands(token + ["--roles", '["inference", "orchestrator"]', "--host-name", "a",
                               "--orchestrator.client.base-urls", '["http://a:8000", "http://c:8000"]',
                               "--trainer-nodes", "2"], tmp_path)
    assert set(host_a) == {"inference", "env-reverse-text", "orchestrator"}  # its env server beside it
    assert str(tmp_path / "run" / "configs" / "a" / "orchestrator.toml") in host_a["orchestrator"]
    config, _ = load(FILES + token + ["--roles", '["inference", "orchestrator"]',
                                      "--orchestrator.client.base-urls", '["http://a:8000"]',
                                      "--trainer-nodes", "2", "--trainer-processes", "2"])
    assert config.orchestrator.client.base_urls == ["http://a:8000"] and config.orchestrator.trainer_world_size == 4
    host_b = commands(token + ["--roles", '["trainer"]', "--host-name", "b", "--trainer-nodes", "2", "--node-rank", "1",
                               "--rdzv-endpoint", "a:29400", "--node-addr", "10.0.0.2"], tmp_path)
    trainer = host_b["trainer"]
    assert set(host_b) == {"trainer"} and "--standalone" not in trainer
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=a:29400", "--local-addr=10.0.0.2"} <= set(trainer)
    assert "--standalone" in commands([], tmp_path)["trainer"]  # one host, as before
    assert trainer[1:3] == ["-m", "rl.trainer.ranks"]  # no trainer GPUs: torchrun's flags, the ranks forked



def test_an_env_run_in_the_orchestrators_process_gets_no_env_server(tmp_path):
    in_process = '[{"id": "reverse-text", "workers": 0}, {"id": "reverse-text", "name": "served"}]'
    children = commands(["--orchestrator.env", in_process], tmp_path)
    assert set(children) == {"inference", "env-served", "orchestrator", "trainer"}
    config, _ = load(FILES + ["--output-dir", str(tmp_path / "run2"), "--orchestrator.env", in_process])
    addressed = [(e.label, e.address is not None) for e in config.orchestrator.env]
    assert addressed == [("reverse-text", False), ("served", True)]
    with pytest.raises(ConfigError, match=r"workers = 0 runs the episodes in the orchestrator's process, and address"):
        load(FILES + ["--orchestrator.env", '[{"id": "reverse-text", "workers": 0, "address": "ipc:///tmp/x.sock"}]'])

HOST_ERRORS = [
    (["--roles", '["orchestrator"]', "--inference.admin-token", "t"], "--orchestrator.client.base-urls"),
    (["--roles", '["trainer"]', "--trainer-nodes", "2", "--inference.admin-token", "t"], "--rdzv-endpoint"),
    (["--trainer-nodes", "2", "--node-rank", "2", "--rdzv-endpoint", "a:1", "--inference.admin-token", "t"],
     "--node-rank 2"),
    (["--roles", '["inference"]'], "the same admin token"),
    (["--inference.host", "0.0.0.0"], "lets other hosts reach the admin routes"),
    (["--roles", '["trainer", "trainer"]', "--inference.admin-token", "t"], "lists a process twice"),
    (["--roles", '["evaluator"]'], "roles.0"),
    (["--rdzv-endpoint", "nohostport"], "rdzv_endpoint"),
    (["--host-name", "a/b"], "host_name"),
]


@pytest.mark.parametrize("argv, named", HOST_ERRORS)
def test_a_host_missing_what_the_others_need_is_refused(argv, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        load(FILES + argv)


def board(tmp_path, name, roles, node=None, nodes=1, timeout_s=3.0) -> HostBoard:
    return HostBoard(RunPaths(tmp_path), name, roles, node, nodes, timeout_s)


def test_the_host_board_says_when_the_run_is_done_and_who_went_down(tmp_path):
    a = board(tmp_path, "a", ("inference", "orchestrator", "trainer"), 0, nodes=2)
    b = board(tmp_path, "b", ("trainer",), 1, nodes=2)
    a.join(), b.join()
    assert not a.run_finished() and a.trouble() is None
    a.beat("finished", force=True)
    a.beat(force=True)  # a heartbeat keeps the state
    assert [h.state for h in b.peers()] == ["finished"]
    assert not a.run_finished()  # trainer node 1 still running
    b.beat("finished", force=True)
    assert a.run_finished() and b.run_finished()
    b.beat("failed", "trainer exited with code 1", force=True)
    assert a.trouble().name == "b" and a.trouble().reason == "trainer exited with code 1"


def test_a_silent_host_is_named_first_down(tmp_path):
    a = board(tmp_path, "a", ("trainer",), 0, nodes=2, timeout_s=1.0)
    b = board(tmp_path, "b", ("trainer",), 1, nodes=2, timeout_s=1.0)
    a.join(), b.join()  # then b is killed: it never beats again
    time.sleep(0.2)
    a.beat("failed", "trainer exited with code 1", force=True)  # its peer vanished under it
    start = time.monotonic()
    assert a.settle().name == "b" and time.monotonic() - start < 4
    assert a.trouble().name == "b" and a.trouble().state == "running"  # silent, not failed
    time.sleep(1.1)
    c = board(tmp_path, "c", ("inference",), timeout_s=1.0)
    c.join()  # a later launch of the run forgets the hosts that stopped beating
    assert [h.name for h in c.hosts()] == ["c"]


def test_a_peer_whose_clock_is_an_hour_behind_is_alive_while_its_file_changes(tmp_path):
    a = board(tmp_path, "a", ("trainer",), 0, nodes=2, timeout_s=1.0)
    a.join()
    behind = Host("b", ("trainer",), "running", "", time.time() - 3600, 1)
    for beat in range(4):  # b beats every 0.5 s with its own (wrong) clock
        atomic_write_text(tmp_path / "hosts" / "b.json", json.dumps(asdict(replace(behind, time=behind.time + beat))))
        assert a.trouble() is None
        time.sleep(0.5)
    time.sleep(1.1)  # then b stops beating: silent on a's own clock
    assert a.trouble().name == "b"


def rendered_k8s(tmp_path, *argv, token: str = "tok3n") -> list[dict]:
    config = parse_config(RLConfig, FILES + ["--output-dir", str(tmp_path / "demo"), "--model.name", "Qwen/Qwen3-0.6B",
                                             "--k8s", *argv])
    return [d for d in yaml.safe_load_all(render_k8s(config, RunPaths(tmp_path / "demo"), token=token)) if d]


def pod_argv(command: str, index: int, files: dict[str, Path]) -> list[str]:
    """What a pod's shell makes of its command at JOB_COMPLETION_INDEX=index (the ConfigMap's files at `files`)."""
    words = subprocess.run(["sh", "-c", "set -- " + command.removeprefix("exec ") + '; printf "%s\\n" "$@"'],
                           env={"JOB_COMPLETION_INDEX": str(index)}, capture_output=True, text=True, check=True)
    return [str(files.get(word, word)) for word in words.stdout.splitlines()[1:]]  # without the rl program


def test_k8s_manifests_pass_kubernetes_schemas_and_each_pod_starts_its_part_of_the_plan(tmp_path, monkeypatch):
    import kubernetes_validate

    from rl.launcher import main as launcher

    documents = rendered_k8s(tmp_path, "--k8s.trainer-pods", "2", "--k8s.inference-pods", "2",
                             "--k8s.trainer-gpus", "8", "--k8s.inference-gpus", "2", "--inference.dtype", "bfloat16")
    for document in documents:
        kubernetes_validate.validate(document, "1.30.0", strict=True)
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in documents)
    assert kinds == ["ConfigMap/rl-config", "Job/rl-inference", "Job/rl-orchestrator", "Job/rl-trainer",
                     "PersistentVolumeClaim/rl-run", "Secret/rl-admin-token",
                     "Service/rl-inference", "Service/rl-trainer"]
    text = yaml.safe_dump_all(documents)
    assert text.count("tok3n") == 1  # the Secret; pods read it into their environment
    data = next(d for d in documents if d["kind"] == "ConfigMap")["data"]
    assert "admin_token" not in data["rl.toml"] and "output_dir" not in data["rl.toml"]
    assert "batch_size = 128" in data["rl.toml"]
    files = {f"/etc/rl/{name}": tmp_path / name for name in data}
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    jobs = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "Job"}
    trainer = jobs["rl-trainer"]
    assert (trainer["completions"], trainer["completionMode"]) == (2, "Indexed")
    assert trainer["template"]["spec"]["subdomain"] == "rl-trainer"
    assert trainer["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 8)
    monkeypatch.setenv("RL_INFERENCE__ADMIN_TOKEN", "tok3n")
    hosts = {}
    for job, spec in jobs.items():
        command = spec["template"]["spec"]["containers"][0]["args"][0]
        for index in range(spec["completions"]):
            config, host = launcher.load(pod_argv(command, index, files))
            hosts[host.name] = (job, host, config)
    assert sorted(hosts) == ["rl-inference-0.rl-inference", "rl-inference-1.rl-inference", "rl-orchestrator",
                             "rl-trainer-0.rl-trainer", "rl-trainer-1.rl-trainer"]
    assert {job: host.roles for job, host, _ in hosts.values()} == {
        "rl-inference": ("inference",), "rl-orchestrator": ("orchestrator",), "rl-trainer": ("trainer",)}
    _, orchestrator, config = hosts["rl-orchestrator"]
    assert config.orchestrator.client.base_urls == [
        "http://rl-inference-0.rl-inference:8000", "http://rl-inference-0.rl-inference:8001",
        "http://rl-inference-1.rl-inference:8000", "http://rl-inference-1.rl-inference:8001"]
    assert config.orchestrator.trainer_world_size == 16
    for rank in (0, 1):
        _, trainer_host, config = hosts[f"rl-trainer-{rank}.rl-trainer"]
        assert (trainer_host.node_rank, trainer_host.rdzv_endpoint) == (rank, "rl-trainer-0.rl-trainer:29400")
        assert trainer_host.devices.trainer_gpus == list(range(8))
    _, inference, config = hosts["rl-inference-1.rl-inference"]
    assert inference.devices.inference_gpus == [[0], [1]] and config.inference.host == "0.0.0.0"


def test_the_inference_and_trainer_pods_get_a_memory_backed_dev_shm_for_nccl(tmp_path):
    """NCCL (and vLLM's workers) share memory through /dev/shm; a container's default 64 MB fails NCCL with "Error
    while creating shared memory segment", so those pods mount a RAM-backed emptyDir there."""
    documents = rendered_k8s(tmp_path, "--k8s.trainer-pods", "2", "--k8s.trainer-gpus", "8",
                             "--k8s.inference-gpus", "2", "--inference.dtype", "bfloat16")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in documents if d["kind"] == "Job"}
    for job in ("rl-inference", "rl-trainer"):
        shm = [v for v in pods[job]["volumes"] if v["name"] == "dshm"]
        assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}], pods[job]["volumes"]
        mounts = pods[job]["containers"][0]["volumeMounts"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts, mounts
    example = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "example.yaml").read_text()) if d]
    for document in example:
        if document["kind"] == "Job" and document["metadata"]["labels"]["rl/role"] in ("inference", "trainer"):
            pod = document["spec"]["template"]["spec"]
            assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
            assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_k8s_with_an_existing_claim_makes_no_volume(tmp_path):
    documents = rendered_k8s(tmp_path, "--k8s.existing-claim", "shared-runs", "--k8s.name", "exp1")
    assert not [d for d in documents if d["kind"] == "PersistentVolumeClaim"]
    volumes = [d["spec"]["template"]["spec"]["volumes"][0] for d in documents if d["kind"] == "Job"]
    assert all(v["persistentVolumeClaim"]["claimName"] == "shared-runs" for v in volumes)
    jobs = {d["metadata"]["name"] for d in documents if d["kind"] == "Job"}
    assert jobs == {"exp1-inference", "exp1-orchestrator", "exp1-trainer"}


def slurm_steps(config: RLConfig, tmp_path, nodes: list[str], env: dict | None = None) -> dict[str, list[str]]:
    """Run the job's script with SLURM's commands stubbed: each node's `rl` command line (srun's arguments
    after the node)."""
    script = slurm_job(config, RunPaths(config.output_dir))
    check = subprocess.run(["bash", "-n", str(script)], text=True, capture_output=True)
    assert check.returncode == 0, check.stderr
    steps = tmp_path / "steps"
    steps.mkdir()
    stubs = (f'scontrol() {{ printf "%s\\n" {" ".join(nodes)}; }}\n'
             f'srun() {{ while [ "$1" != -w ]; do shift; done; node=$2; shift 2; '
             f'printf "%s\\0" "$@" > {shlex.quote(str(steps))}/"$node"; }}\n')
    ran = subprocess.run(["bash", "-c", stubs + f"source {shlex.quote(str(script))}"], text=True, capture_output=True,
                         env={"SLURM_JOB_NODELIST": "stubbed", "PATH": "/usr/bin:/bin"} | (env or {}))
    assert ran.returncode == 0, ran.stderr
    return {node: (steps / node).read_text().split("\0")[:-1] for node in nodes}


def slurm_hosts(tmp_path, monkeypatch, gpus: int, argv: list[str], nodes: list[str]):
    """Each node's (resolved config, plan) as `rl` on it computes them from the rendered job."""
    from rl.launcher import main as launcher

    config = parse_config(RLConfig, FILES + ["--output-dir", str(tmp_path / "run"), "--slurm", *argv])
    steps = slurm_steps(config, tmp_path, nodes)
    monkeypatch.setattr(launcher, "cuda_device_count", lambda: gpus)
    monkeypatch.setenv("RL_INFERENCE__ADMIN_TOKEN", "t0ken")
    found = {}
    for node, argv in steps.items():
        assert argv[1:3] == ["-m", "rl.launcher.main"]
        config, host = launcher.load(argv[3:])
        found[node] = (config, host)
    return found


def test_the_slurm_job_places_a_trainer_beside_inference_on_the_first_node_with_every_server_listed(
    tmp_path, monkeypatch
):
    """The defect this plan fixes: with the trainer beside inference, the first node splits its GPUs and starts
    half as many servers as a node running inference alone; the orchestrator lists exactly those."""
    hosts = slurm_hosts(tmp_path, monkeypatch, 4, ["--inference.dtype", "bfloat16",
                                                    "--trainer-gpus", "2", "--inference-gpus", "2",
                                                    "--slurm.inference-nodes", "2",
                                                    "--slurm.trainer-nodes", "0",
                                                    "--slurm.gpus-per-node", "4", "--slurm.partition", "gpu"],
                        ["n1", "n2"])
    (first_config, first), (_, second) = hosts["n1"], hosts["n2"]
    assert first.roles == ("inference", "orchestrator", "trainer") and second.roles == ("inference",)
    assert first.devices.inference_gpus == [[0], [1]] and first.devices.trainer_gpus == [2, 3]
    assert second.devices.inference_gpus == [[0], [1], [2], [3]]
    assert first_config.orchestrator.client.base_urls == [
        "http://n1:8000", "http://n1:8001", "http://n2:8000", "http://n2:8001", "http://n2:8002", "http://n2:8003"]
    assert first.trainer_nodes == 1 and first_config.orchestrator.trainer_world_size == 2
    script = (tmp_path / "run" / "slurm" / "rl.sbatch").read_text()
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --nodes=2" in script
    assert ("#   node 0: inference (2 servers on GPUs [0] [1]), orchestrator (to 6 servers), "
            "trainer node 0 of 1 (2 GPUs)") in script


def test_tensor_parallel_servers_keep_their_gpus_on_one_node_in_the_slurm_job_and_the_k8s_pods(tmp_path, monkeypatch):
    tp4 = ["--inference.dtype", "bfloat16", "--inference.tensor-parallel-size", "4"]
    hosts = slurm_hosts(tmp_path, monkeypatch, 8, tp4 + ["--slurm.gpus-per-node", "8"], ["n1", "n2"])
    (config, inference), (_, trainer) = hosts["n1"], hosts["n2"]
    assert inference.devices.inference_gpus == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert trainer.devices.trainer_gpus == list(range(8))
    assert config.orchestrator.client.base_urls == ["http://n1:8000", "http://n1:8001"]
    script = (tmp_path / "run" / "slurm" / "rl.sbatch").read_text()
    assert "#   node 0: inference (2 servers on GPUs [0,1,2,3] [4,5,6,7]), orchestrator (to 2 servers)" in script
    k8s = FILES + ["--output-dir", str(tmp_path / "d"), "--model.name", "m/m", "--k8s", *tp4]
    text = render_k8s(parse_config(RLConfig, k8s + ["--k8s.inference-gpus", "8"]), RunPaths(tmp_path / "d"))
    assert "#   rl-inference-0.rl-inference: inference (2 servers on GPUs [0,1,2,3] [4,5,6,7])" in text
    with pytest.raises(ConfigError, match=r"6 inference GPUs .* = 4 GPUs each: .*--k8s.inference-gpus"):
        render_k8s(parse_config(RLConfig, k8s + ["--k8s.inference-gpus", "6"]), RunPaths(tmp_path / "d"))


def test_the_slurm_job_gives_each_trainer_node_its_rank_and_the_first_ones_rendezvous(tmp_path, monkeypatch):
    hosts = slurm_hosts(tmp_path, monkeypatch, 0, ["--slurm.trainer-nodes", "2", "--trainer-processes", "2",
                                                    "--slurm.setup", '["true module load cuda"]'], ["a", "b", "c"])
    assert [host.roles for _, host in hosts.values()] == [("inference", "orchestrator"), ("trainer",), ("trainer",)]
    assert [(host.node_rank, host.rdzv_endpoint, host.node_addr) for _, host in list(hosts.values())[1:]] == [
        (0, "b:29400", "b"), (1, "b:29400", "c")]
    config, host = hosts["a"]
    assert config.orchestrator.client.base_urls == ["http://a:8000"] and config.orchestrator.trainer_world_size == 4
    assert config.inference.host == "0.0.0.0" and host.spans_hosts
    assert "true module load cuda" in (tmp_path / "run" / "slurm" / "rl.sbatch").read_text()


def test_the_config_every_host_starts_from_is_the_one_given(tmp_path):
    argv = FILES + ["--max-steps", "7", "--inference.admin-token", "s3cret", "--roles", '["trainer"]',
                    "--trainer-nodes", "2", "--output-dir", str(tmp_path / "x")]
    text = as_given(parse_config(RLConfig, argv), "/shared/run")
    given = tmp_path / "given.toml"
    again = parse_config(RLConfig, ["@", str(given)]) if given.write_text(text) else None
    assert again.max_steps == 7 and again.output_dir.as_posix() == "/shared/run"
    assert again.trainer.micro_batch_size == 16 and again.orchestrator.batch_size == 128  # the files, merged
    assert "s3cret" not in text and "roles" not in text and "trainer_nodes" not in text


def test_the_committed_example_is_what_rl_renders_today(capsys, monkeypatch):
    import kubernetes_validate

    from rl.launcher import main as launcher

    monkeypatch.chdir(ROOT)
    launcher.main((ROOT / "deploy" / "k8s" / "example.args").read_text().split())
    rendered = capsys.readouterr().out
    assert rendered == (ROOT / "deploy" / "k8s" / "example.yaml").read_text(), "run: bash deploy/render-example.sh"
    for document in yaml.safe_load_all(rendered):
        kubernetes_validate.validate(document, "1.30.0", strict=True)


# ---- Values in the renders: refused where they would break their line, quoted or dumped as data elsewhere ----

# Printable, but the syntax of a shell, an #SBATCH line and YAML: quotes, a command substitution, a comment.
HOSTILE = "q'd \"dq\" $(touch pwned) `touch pwned` #c: {x: y}"

SLURM_REFUSED = [
    (["--output-dir", "{tmp}/run\ntouch pwned"], "output_dir"),
    (["--output-dir", "{tmp}/run\rx"], "output_dir"),
    (["--output-dir", "{tmp}/run%j"], "output_dir"),  # sbatch's --output reads it as a pattern
    (["--output-dir", "{tmp}/a\\b"], "output_dir"),  # sbatch's #SBATCH lines read it as an escape
    (["--slurm.partition", "gpu\ntouch pwned"], "slurm.partition"),
    (["--slurm.partition", "gpu #x"], "slurm.partition"),
    (["--slurm.account", "a\tb"], "slurm.account"),
    (["--slurm.sbatch", '["--qos=high\\ntouch pwned"]'], "slurm.sbatch"),
    (["--slurm.setup", '["module load cuda\\u0000"]'], "slurm.setup"),
]


@pytest.mark.parametrize("argv, field", SLURM_REFUSED)
def test_the_slurm_job_refuses_a_value_that_would_break_out_of_its_line(tmp_path, argv, field):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    with pytest.raises(ConfigError, match=re.escape(field)):
        config = parse_config(RLConfig, FILES + ["--output-dir", str(tmp_path / "run"), "--slurm", *argv])
        slurm_job(config, RunPaths(config.output_dir))
    assert not list(tmp_path.rglob("rl.sbatch")) and not list(tmp_path.rglob("pwned"))


@pytest.mark.parametrize("argv, wanted", [
    (["--slurm.gpus-per-node", "8"], ["#SBATCH --exclusive", "#SBATCH --mem=0"]),  # whole nodes: not one core each
    (["--slurm.gpus-per-node", "8", "--slurm.exclusive", "false", "--slurm.mem", "500G"], ["#SBATCH --mem=500G"]),
    ([], []),  # CPU nodes: as the cluster allocates
])
def test_a_gpu_job_takes_whole_nodes_and_their_memory_unless_told_otherwise(tmp_path, argv, wanted):
    config = parse_config(RLConfig, FILES + ["--output-dir", str(tmp_path / "run"), "--slurm", *argv])
    script = render_slurm(config, RunPaths(tmp_path / "run"), tmp_path / "rl.toml", tmp_path / "placement.toml")
    claimed = [line for line in script.splitlines() if line.startswith(("#SBATCH --exclusive", "#SBATCH --mem"))]
    assert claimed == wanted


def test_the_slurm_job_quotes_what_it_renders_and_keeps_values_out_of_comment_lines(tmp_path, monkeypatch):
    run = tmp_path / f"run {HOSTILE}"
    monkeypatch.chdir(tmp_path)
    config = parse_config(RLConfig, FILES + ["--output-dir", str(run), "--slurm",
                                             "--slurm.sbatch", json.dumps(["--comment='a b #c'"])])
    steps = slurm_steps(config, tmp_path, ["n1", "n2"])  # bash -n, then run with srun stubbed
    for argv in steps.values():
        assert argv[3:7] == ["@", str(run / "slurm" / "rl.toml"), "@", str(run / "slurm" / "placement.toml")]
    assert not list(tmp_path.rglob("pwned"))
    lines = (run / "slurm" / "rl.sbatch").read_text().splitlines()
    comments = [line for line in lines if line.startswith("#") and not line.startswith(("#!", "#SBATCH"))]
    assert not [line for line in comments if "pwned" in line or str(tmp_path) in line], comments
    output = next(line for line in lines if line.startswith("#SBATCH --output="))
    assert shlex.split(output.removeprefix("#SBATCH ")) == [f"--output={run}/slurm/%j.log"]  # as sbatch reads it
    assert "#SBATCH --comment='a b #c'" in lines


def shape(node, path: str = "") -> set[str]:
    """Every key path of a parsed document (list items by position): its structure, without the values."""
    if isinstance(node, dict):
        return {path} | {p for key, value in node.items() for p in shape(value, f"{path}/{key}")}
    if isinstance(node, list):
        return {path} | {p for i, value in enumerate(node) for p in shape(value, f"{path}/{i}")}
    return {path}


def test_k8s_values_are_dumped_as_data_and_never_change_the_manifests_structure(tmp_path):
    plain = rendered_k8s(tmp_path, "--k8s.storage-class", "fast", "--k8s.env", '{"A": "b"}')
    token = 'tok3n"\n  extra: key'
    image = "rl:latest\n  securityContext: {privileged: true}"
    storage = '1Gi"\n    limits: {storage: 1Ti}'
    documents = rendered_k8s(tmp_path, "--k8s.image", image, "--k8s.storage-size", storage,
                             "--k8s.storage-class", HOSTILE, "--k8s.env", json.dumps({"A": HOSTILE + "\nline 2"}),
                             token=token)
    assert [shape(d) for d in documents] == [shape(d) for d in plain]
    assert not [path for d in documents for path in shape(d) if "securityContext" in path or "extra" in path]
    secret = next(d for d in documents if d["kind"] == "Secret")
    assert secret["stringData"] == {"token": token}
    claim = next(d for d in documents if d["kind"] == "PersistentVolumeClaim")["spec"]
    assert (claim["resources"]["requests"]["storage"], claim["storageClassName"]) == (storage, HOSTILE)
    for job in (d for d in documents if d["kind"] == "Job"):
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert container["image"] == image and container["env"][-1] == {"name": "A", "value": HOSTILE + "\nline 2"}
    claimed = rendered_k8s(tmp_path, "--k8s.existing-claim", HOSTILE)
    assert [shape(d) for d in claimed] == [shape(d) for d in rendered_k8s(tmp_path, "--k8s.existing-claim", "c")]
    volumes = [d["spec"]["template"]["spec"]["volumes"][0] for d in claimed if d["kind"] == "Job"]
    assert {v["persistentVolumeClaim"]["claimName"] for v in volumes} == {HOSTILE}


@pytest.mark.parametrize("argv, field", [
    (["--k8s.env", '{"A B": "x"}'], "k8s.env"),
    (["--k8s.env", '{"A\\nB: c": "x"}'], "k8s.env"),
    (["--k8s.env", '{"1A": "x"}'], "k8s.env"),
    (["--k8s.mount-path", "/rl\n  - {name: x}"], "k8s.mount_path"),
])
def test_k8s_values_kubernetes_refuses_are_refused_by_name(tmp_path, argv, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        rendered_k8s(tmp_path, *argv)


def test_the_api_key_reaches_the_pods_from_a_secret_and_no_shared_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_INFERENCE__API_KEY", "k3y-from-env")
    documents = rendered_k8s(tmp_path)
    secrets = {d["metadata"]["name"]: d["stringData"] for d in documents if d["kind"] == "Secret"}
    assert secrets == {"rl-admin-token": {"token": "tok3n"}, "rl-api-key": {"key": "k3y-from-env"}}
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    assert "k3y-from-env" not in str(config_map) and "api_key" not in str(config_map)
    for job in (d for d in documents if d["kind"] == "Job"):
        env = job["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "RL_INFERENCE__API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "rl-api-key", "key": "key"}}} in env


def test_the_slurm_job_takes_the_api_key_from_its_environment_and_no_file(tmp_path, monkeypatch):
    from rl.launcher.deploy import submit

    config = parse_config(RLConfig, FILES + ["--output-dir", str(tmp_path / "run"), "--slurm",
                                             "--inference.api-key", "k3y-given"])
    with pytest.raises(AssertionError, match="export RL_INFERENCE__API_KEY"):
        slurm_steps(config, tmp_path, ["n1", "n2"])  # run without the key: the job stops before any step
    written = [p.read_text() for p in (tmp_path / "run" / "slurm").iterdir()]
    assert len(written) == 3 and not [text for text in written if "k3y-given" in text]
    (tmp_path / "steps").rmdir()
    slurm_steps(config, tmp_path, ["n1", "n2"], env={"RL_INFERENCE__API_KEY": "k3y-given"})
    bin_dir = tmp_path / "bin"  # an sbatch that records the key in the environment it was given
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$RL_INFERENCE__API_KEY" > {tmp_path}/key; echo 42\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert submit(tmp_path / "run" / "slurm" / "rl.sbatch", config) == "42"
    assert (tmp_path / "key").read_text() == "k3y-given\n"


def test_weights_over_the_wire_reach_every_pod_and_node_with_one_secret_and_no_file_holds_it(tmp_path, monkeypatch):
    documents = rendered_k8s(tmp_path, "--transfer.backend", "gloo")
    secrets = {d["metadata"]["name"]: d["stringData"] for d in documents if d["kind"] == "Secret"}
    secret = secrets["rl-transfer-secret"]["secret"]
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    assert secret not in str(next(d for d in documents if d["kind"] == "ConfigMap"))
    for job in (d for d in documents if d["kind"] == "Job"):
        given = {"name": "RL_TRANSFER__SECRET", "valueFrom": {"secretKeyRef": {"name": "rl-transfer-secret",
                                                                               "key": "secret"}}} \
            in job["spec"]["template"]["spec"]["containers"][0]["env"]
        assert given == (job["metadata"]["labels"]["rl/role"] != "orchestrator")  # it runs environments' code

    config = parse_config(RLConfig, FILES + ["--output-dir", str(tmp_path / "run"), "--slurm",
                                             "--transfer.backend", "gloo"])
    script = slurm_job(config, RunPaths(config.output_dir))
    seen = tmp_path / "seen"  # each node's step records the secret in its environment
    stubs = ('scontrol() { printf "%s\\n" n1 n2; }\n'
             f'srun() {{ echo "$RL_TRANSFER__SECRET" >> {shlex.quote(str(seen))}; }}\n')
    ran = subprocess.run(["bash", "-c", stubs + f"source {shlex.quote(str(script))}"], text=True, capture_output=True,
                         env={"SLURM_JOB_NODELIST": "stubbed", "PATH": "/usr/bin:/bin"})
    assert ran.returncode == 0, ran.stderr
    given = seen.read_text().split()
    assert len(given) == 2 and len(set(given)) == 1 and re.fullmatch(r"[0-9a-f]{64}", given[0])
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file() and given[0] in p.read_text()]


def test_an_orchestrators_host_needs_and_holds_no_transfer_secret(tmp_path, monkeypatch):
    """The orchestrator runs environments' code: its host's launcher neither asks for the transfer secret nor makes
    one, so its pod gets none and its orchestrator may be forked."""
    from rl.launcher.main import ORCHESTRATOR_SECRETS, holds_more_than

    monkeypatch.delenv("RL_TRANSFER__SECRET", raising=False)
    config, host = load(FILES + ["--output-dir", str(tmp_path / "run"), "--roles", '["orchestrator"]',
                                 "--orchestrator.client.base-urls", '["http://a:8000"]', "--inference.admin-token", "t",
                                 "--transfer.backend", "gloo", "--transfer.host", "10.0.0.1", "--trainer-nodes", "2"])
    assert host.spans_hosts and not host.runs("trainer")
    assert config.trainer.transfer.secret is None and config.orchestrator.transfer.secret is None
    assert not holds_more_than(config, ORCHESTRATOR_SECRETS)


def test_a_slurm_nodes_step_holds_only_the_secrets_of_its_roles(tmp_path, monkeypatch):
    """With the orchestrator on a node of its own, that node's step (where environments run others' code) has no
    transfer secret in its environment; the inference and trainer nodes have the job's one; all have the admin
    token; and each node runs the roles the plan gives it."""
    config = parse_config(RLConfig, FILES + ["--output-dir", str(tmp_path / "run"), "--slurm",
                                             "--slurm.orchestrator-node", "true", "--transfer.backend", "gloo"])
    script = slurm_job(config, RunPaths(config.output_dir))
    seen = tmp_path / "seen"
    stubs = ('scontrol() { printf "%s\\n" n1 n2 n3; }\n'
             'srun() { while [ "$1" != -w ]; do shift; done; '
             'echo "$2 ${RL_TRANSFER__SECRET:-none} ${RL_INFERENCE__ADMIN_TOKEN:-none}" '
             f'>> {shlex.quote(str(seen))}; }}\n')
    ran = subprocess.run(["bash", "-c", stubs + f"source {shlex.quote(str(script))}"], text=True, capture_output=True,
                         env={"SLURM_JOB_NODELIST": "stubbed", "PATH": "/usr/bin:/bin"})
    assert ran.returncode == 0, ran.stderr
    given = {node: (secret, token) for node, secret, token in (line.split() for line in seen.read_text().splitlines())}
    assert given["n2"][0] == "none" and re.fullmatch(r"[0-9a-f]{64}", given["n1"][0])
    assert given["n3"][0] == given["n1"][0]
    assert len({token for _, token in given.values()}) == 1 and "none" not in {token for _, token in given.values()}
    steps = slurm_steps(config, tmp_path, ["n1", "n2", "n3"])
    monkeypatch.setenv("RL_TRANSFER__SECRET", "s" * 64)
    monkeypatch.setenv("RL_INFERENCE__ADMIN_TOKEN", "t0ken")
    roles = {node: load(argv[3:])[1].roles for node, argv in steps.items()}
    assert roles == {"n1": ("inference",), "n2": ("orchestrator",), "n3": ("trainer",)}
