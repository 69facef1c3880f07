import json
import sys
import typing
from pathlib import Path

import pytest

from rl.config import ConfigError, parse_argv, parse_config, without_secrets
from rl.launcher.config import RLConfig
from rl.launcher.resolve import resolve
from rl.launcher.devices import DevicePlan, cpu_plan
from rl.launcher.main import child_specs, load, plan_devices
from rl.launcher.placement import given_host
from rl.launcher.hosts import HostBoard
from rl.launcher.supervisor import ChildSpec, Supervisor
from rl.protocol import RunPaths
from rl.trainer.config import TrainerConfig


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_toml_files_merge_left_to_right_and_cli_wins(tmp_path):
    a = write(tmp_path, "a.toml", "max_steps = 3\n[optim]\nlr = 0.1\nweight_decay = 0.5\n")
    b = write(tmp_path, "b.toml", "[optim]\nlr = 0.2\n")
    config = parse_config(TrainerConfig, ["@", a, f"@{b}", "--max-steps", "7"])
    assert config.optim.lr == 0.2
    assert config.optim.weight_decay == 0.5  # kept from a.toml: tables merge, not replace
    assert config.max_steps == 7


def test_environment_sits_between_toml_and_cli(tmp_path, monkeypatch):
    a = write(tmp_path, "a.toml", "[optim]\nlr = 0.1\n")
    monkeypatch.setenv("RL_TRAINER__OPTIM__LR", "0.3")
    assert parse_config(TrainerConfig, ["@", a]).optim.lr == 0.3
    assert parse_config(TrainerConfig, ["@", a, "--optim.lr", "0.4"]).optim.lr == 0.4


def test_unknown_field_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="optim.lrr"):
        parse_config(TrainerConfig, ["--optim.lrr", "1"])
    bad = write(tmp_path, "bad.toml", "[optim]\nbetaz = 1\n")
    with pytest.raises(ConfigError, match="optim.betaz"):
        parse_config(TrainerConfig, ["@", bad])


def test_bad_value_and_missing_file_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="max_steps"):
        parse_config(TrainerConfig, ["--max-steps", "zero"])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(TrainerConfig, ["@", str(tmp_path / "nope.toml")])
    broken = write(tmp_path, "broken.toml", "max_steps = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config(TrainerConfig, ["@", broken])


def test_flags_and_lists():
    toml_data, cli = parse_argv(["--dry-run", "--no-enforce-eager", "--x.y=[1, 2]"])
    assert toml_data == {}
    assert cli == {"dry_run": "true", "enforce_eager": "false", "x": {"y": [1, 2]}}


def test_a_section_flag_after_its_fields_keeps_them_in_either_order():
    """`--slurm.partition gpu --slurm` dropped the partition: the bare flag replaced the section's table."""
    for argv in (["--slurm.partition", "gpu", "--slurm"], ["--slurm", "--slurm.partition", "gpu"]):
        assert parse_argv(argv)[1] == {"slurm": {"partition": "gpu"}}, argv
    assert parse_argv(["--x.a=1", '--x={"b": 2}'])[1] == {"x": {"a": "1", "b": 2}}
    with pytest.raises(ConfigError, match="--slurm false conflicts with the --slurm.\\* settings given before it"):
        parse_argv(["--slurm.partition", "gpu", "--no-slurm"])


def test_secrets_are_masked_for_printing_and_dropped_from_files_shared_with_hosts():
    dump = {"inference": {"admin_token": "s3cret", "api_key": "k3y", "port": 8000},
            "servers": [{"admin_token": "s3cret"}], "admin_token": None,
            "urls": ["https://user:pa55@host:8000/v1", "http://host/v1", "a@b"]}
    urls = ["https://user:<hidden>@host:8000/v1", "http://host/v1", "a@b"]
    assert without_secrets(dump, drop=False) == {
        "inference": {"admin_token": "<hidden>", "api_key": "<hidden>", "port": 8000},
        "servers": [{"admin_token": "<hidden>"}], "admin_token": None, "urls": urls}
    assert without_secrets(dump, drop=True) == {"inference": {"port": 8000}, "servers": [{}], "urls": urls}


def test_the_api_key_is_a_field_passed_to_vllm_never_an_extra_arg():
    from rl.inference.config import InferenceConfig
    from rl.inference.server import vllm_argv

    argv = vllm_argv(InferenceConfig(dtype="auto", api_key="k3y"), "/m", 0.2, [])
    assert argv[argv.index("--api-key") + 1] == "k3y"
    assert "--api-key" not in vllm_argv(InferenceConfig(dtype="auto"), "/m", 0.2, [])
    for extra in (["--api-key", "k3y"], ["--api-key=k3y"], ["--api_key", "k3y"], ["--api-ke", "k3y"]):
        with pytest.raises(ConfigError, match=r"inference\.extra_args: .*set inference\.api_key") as refused:
            parse_config(RLConfig, ["--inference.extra-args", json.dumps(extra)])
        assert "k3y" not in str(refused.value)
    kept = ["--api-server-count", "2"]
    assert parse_config(RLConfig, ["--inference.extra-args", json.dumps(kept)]).inference.extra_args == kept


def test_eval_records_and_prints_its_config_with_the_url_password_and_keys_masked(tmp_path, monkeypatch, capsys):
    from rl.eval import main as eval_main
    from rl.eval.serving import EvalError

    def no_server(*args, **kwargs):
        raise EvalError("no server here")

    monkeypatch.setattr(eval_main, "wait_for_models", no_server)
    monkeypatch.setenv("RL_EVAL__INFERENCE__API_KEY", "s3cret-key")
    out = tmp_path / "eval"
    with pytest.raises(SystemExit):
        eval_main.main(["--model.name", "m", "--client.base-url", "https://me:s3cret-pw@api.example.com/v1",
                        "--output-dir", str(out)])
    text = (out / "configs" / "eval.toml").read_text()
    assert "https://me:<hidden>@api.example.com/v1" in text and 'api_key = "<hidden>"' in text
    printed = capsys.readouterr()
    assert "waiting for inference server https://me:<hidden>@api.example.com/v1" in printed.out + printed.err
    assert "s3cret" not in text + printed.out + printed.err


def test_rl_sections_from_files_and_one_rl_toml(tmp_path):
    t = write(tmp_path, "t.toml", "micro_batch_size = 4\n")
    o = write(tmp_path, "o.toml", "batch_size = 16\nrollouts_per_example = 4\n")
    config = parse_config(RLConfig, ["--trainer", "@", t, "--orchestrator", "@", o, "--max-steps", "5"])
    assert config.trainer.micro_batch_size == 4 and config.orchestrator.batch_size == 16
    rl = write(tmp_path, "rl.toml", "max_steps = 4\n[trainer]\nmicro_batch_size = 2\n[inference]\nport = 9100\n")
    config = parse_config(RLConfig, ["@", rl])
    assert config.trainer.micro_batch_size == 2 and config.inference.port == 9100 and config.max_steps == 4


def test_shared_fields_fill_every_process():
    config = parse_config(
        RLConfig,
        ["--model.name", "m", "--output-dir", "/tmp/x", "--max-steps", "5", "--async-level", "2", "--seq-len", "256",
         "--wandb.project", "p", "--ckpt.interval", "2", "--inference-replicas", "2", "--trainer-processes", "2"],
    )
    r = resolve(config, given_host(config, cpu_plan(2, 2)))
    assert r.trainer.model.name == r.orchestrator.model.name == r.inference.model.name == "m"
    assert r.trainer.output_dir == r.orchestrator.output_dir == Path("/tmp/x")
    assert r.trainer.max_steps == r.orchestrator.max_steps == 5
    assert r.orchestrator.async_level == 2
    assert r.trainer.seq_len == r.orchestrator.seq_len == r.inference.max_model_len == 256
    assert r.trainer.wandb.project == r.orchestrator.wandb.project == "p"
    assert r.trainer.ckpt.interval == r.orchestrator.ckpt.interval == 2
    assert r.orchestrator.client.base_urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert r.orchestrator.client.admin_token == r.inference.admin_token is not None
    assert r.inference.weights_dir == Path("/tmp/x/weights")
    assert r.orchestrator.trainer_world_size == 2


def test_shared_value_contradicting_a_subconfig_names_both(tmp_path):
    t = write(tmp_path, "t.toml", "max_steps = 3\n")
    config = parse_config(RLConfig, ["--trainer", "@", t, "--max-steps", "5"])
    with pytest.raises(ConfigError, match=r"max-steps.*5.*trainer.max_steps.*3"):
        resolve(config, given_host(config, cpu_plan(2, 1)))
    # the same value in both places is fine
    config = parse_config(RLConfig, ["--trainer", "@", t, "--max-steps", "3"])
    assert resolve(config, given_host(config, cpu_plan(2, 1))).orchestrator.max_steps == 3


def test_processes_that_disagree_without_shared_flag_are_an_error():
    config = parse_config(RLConfig, ["--trainer.max-steps", "3", "--orchestrator.max-steps", "4"])
    with pytest.raises(ConfigError, match="max_steps differs"):
        resolve(config, given_host(config, cpu_plan(2, 1)))


def test_batch_that_does_not_split_over_ranks_fails_before_start():
    with pytest.raises(ConfigError, match="trainer_world_size"):
        load(["--orchestrator.batch-size", "6", "--orchestrator.rollouts-per-example", "3", "--trainer-processes", "4"])


def test_gpu_flags_refused_on_cpu_host():
    config = parse_config(RLConfig, ["--trainer-gpus", "1"])
    with pytest.raises(ConfigError, match="no GPU is visible"):
        plan_devices(config, available=0)


def test_trainer_takes_the_sampling_temperature():
    config, _ = load(["--orchestrator.sampling.temperature", "0.7"])
    assert config.trainer.temperature == 0.7
    with pytest.raises(ConfigError, match="contradicts trainer.temperature"):
        load(["--orchestrator.sampling.temperature", "0.7", "--trainer.temperature", "0.5"])


def test_router_replay_is_the_trainers_setting_and_inference_records_where_it_replays():
    for replays in (True, False):
        config, _ = load(["--trainer.loss.router-replay", str(replays).lower()])
        assert config.inference.router_replay is replays
    config, _ = load(["--trainer.loss.router-replay", "false", "--inference.router-replay", "true"])
    assert config.inference.router_replay is True  # a record only compared with the trainer's router
    with pytest.raises(ConfigError, match="inference.router_replay = false records nothing"):
        load(["--inference.router-replay", "false"])


def test_cpu_host_defaults_to_one_trainer_process_whose_openmp_workers_sleep(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    config, host = load(["--output-dir", str(tmp_path)])
    assert host.devices.trainer_processes == 1 and config.orchestrator.trainer_world_size == 1
    envs = {spec.name: spec.env for spec in child_specs(config, host, RunPaths(tmp_path))}
    assert envs == {"inference": {}, "env-reverse-text": {}, "orchestrator": {},
                    "trainer": {"OMP_WAIT_POLICY": "PASSIVE"}}
    gpu_host = given_host(config, DevicePlan(2, [2, 3], [[0], [1]]))
    assert all("OMP_WAIT_POLICY" not in spec.env for spec in child_specs(config, gpu_host, RunPaths(tmp_path)))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice wins
    assert all(spec.env == {} for spec in child_specs(config, host, RunPaths(tmp_path)))


def test_child_gets_its_spec_environment_over_the_launchers(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_TEST_A", "launcher")
    monkeypatch.setenv("RL_TEST_B", "launcher")
    code = "import os; print(os.environ['RL_TEST_A'], os.environ['RL_TEST_B'], os.environ['RL_TEST_KEY'])"
    spec = ChildSpec("child", [sys.executable, "-c", code], None, tmp_path / "child.log", {"RL_TEST_A": "spec"},
                     secret_env={"RL_TEST_KEY": "s3cret"})
    supervisor = Supervisor(RunPaths(tmp_path), tail_lines=5, shutdown_timeout_s=5)
    supervisor.start(spec)
    assert supervisor.procs["child"].wait(timeout=30) == 0
    assert spec.log.read_text().split() == ["spec", "launcher", "s3cret"]
    assert "s3cret" not in str(spec.extra_env)  # what --dry-run prints


def test_a_child_killed_by_a_signal_is_named_as_the_cause_of_the_others_exit(tmp_path, capsys):
    """Ended in the same poll: the orchestrator's exit (code 1) follows the inference server's death."""
    supervisor = Supervisor(RunPaths(tmp_path), tail_lines=5, shutdown_timeout_s=5)
    for name, code in [("orchestrator", "raise SystemExit(1)"), ("inference", "import os; os.kill(os.getpid(), 9)")]:
        supervisor.start(ChildSpec(name, [sys.executable, "-c", code], None, tmp_path / f"{name}.log"))
    for proc in supervisor.procs.values():
        proc.wait(timeout=30)
    board = HostBoard(RunPaths(tmp_path), "host", ("inference", "orchestrator"), None, 1, timeout_s=15)
    assert supervisor._watch(board) == 1
    assert board.hosts()[0].state == "failed" and board.hosts()[0].reason == "inference was killed by SIGKILL"
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("rl: inference was killed by SIGKILL; last lines of")
    assert err[-1].startswith("rl: orchestrator exited with code 1 too")


@pytest.mark.parametrize("orch", ["reverse_text", "mixed"])
def test_example_configs_pass_every_start_up_check(orch, tmp_path, capsys):
    """`rl --dry-run` with the example configs: configs resolve and every environment loads."""
    from rl.launcher import main as launcher

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    configs = Path(__file__).resolve().parents[2] / "configs"
    launcher.main([
        "--trainer", "@", str(configs / "reverse_text" / "train.toml"),
        "--orchestrator", "@", str(configs / orch / "orch.toml"),
        "--inference", "@", str(configs / "reverse_text" / "infer.toml"),
        "--model.name", str(model), "--output-dir", str(tmp_path / "run"), "--dry-run",
    ])
    assert "# ---- commands ----" in capsys.readouterr().out


def test_help_lists_the_fields_of_every_variant_of_a_tagged_union():
    from rl.config_help import config_help
    from rl.orchestrator.config import OrchestratorConfig
    from rl.trainer.config import TrainerConfig

    trainer = config_help(TrainerConfig)
    assert "--loss.norm.type  ['dapo']" in trainer and "one of 'dapo', 'grpo', 'dr_grpo'" in trainer
    assert "with type = 'gspo':\n      --loss.objective.eps_low  [0.0003]" in trainer
    assert "--loss.objective.max_weight" in trainer and "--loss.norm.tokens_per_sample" in trainer
    assert "truncate (cap), mask (max_log_ratio), icepop, geo_mask, outlier_mask (low, high)" in trainer  # a list
    orchestrator = config_help(OrchestratorConfig)
    assert "--advantage.type  ['grpo']" in orchestrator and "--advantage.truncated" in orchestrator


def leaf_fields(cls, prefix: str = "") -> list[str]:
    """Every field's dotted name, through sections and lists of tables (a tagged union's are tested above)."""
    from pydantic import BaseModel

    names = []
    for name, field in cls.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if field.discriminator:
            names.append(f"{prefix}{name}.{field.discriminator}")
        elif len(models) == 1:
            names += leaf_fields(models[0], prefix + name + ".")
        else:
            names.append(prefix + name)
    return names


def test_help_names_every_field_of_every_command():
    from rl.config_help import config_help
    from rl.eval.config import EvalCommandConfig
    from rl.trainer.sft import SFTConfig

    for cls in (RLConfig, EvalCommandConfig, SFTConfig):
        text = config_help(cls)
        in_table = lambda name, depth: f"      {'.'.join(name.split('.')[-depth:])}  " in text  # noqa: E731
        listed = lambda name: f"--{name}  " in text or in_table(name, 1) or in_table(name, 2)  # noqa: E731
        assert [name for name in leaf_fields(cls) if not listed(name)] == [], cls.__name__


def test_sft_speaks_the_trainers_words_and_names_the_old_ones():
    from rl.trainer.sft import SFTConfig

    config = parse_config(SFTConfig, ["@", str(Path(__file__).resolve().parents[2] / "configs/reverse_text/sft.toml")])
    assert (config.max_steps, config.optim.lr, config.optim.schedule, config.dtype) == (200, 3e-3, "cosine", "auto")
    with pytest.raises(ConfigError, match="out is now output_dir; steps is now max_steps; lr is now optim.lr"):
        parse_config(SFTConfig, ["--out", "x", "--steps", "3", "--lr", "0.1"])


def test_one_field_of_a_section_given_leaves_its_other_fields_to_the_launcher(monkeypatch):
    """Setting client.timeout_s alone does not count as setting client.admin_token (which rl fills), from the
    command line or the environment; a section's own default values stay (SFT's optim keeps its schedule)."""
    config, _ = load(["--orchestrator.client.timeout-s", "5"])
    assert config.orchestrator.client.timeout_s == 5 and config.orchestrator.client.admin_token
    monkeypatch.setenv("RL_ORCHESTRATOR__CLIENT__STARTUP_TIMEOUT_S", "7")
    config, _ = load([])
    assert config.orchestrator.client.startup_timeout_s == 7 and config.orchestrator.client.admin_token
    from rl.trainer.sft import SFTConfig

    sft = parse_config(SFTConfig, ["--optim.lr", "0.5"])
    assert (sft.optim.lr, sft.optim.schedule, sft.optim.model_fields_set) == (0.5, "cosine", {"lr"})


def test_eval_and_the_orchestrator_bound_rollouts_with_the_same_words():
    from rl.eval.config import EvalCommandConfig

    config = parse_config(EvalCommandConfig, ["--rollout.max-retries", "0"])
    assert (config.rollout.max_retries, config.rollout.timeout_s) == (0, 3600.0)  # eval's own default deadline kept
    orchestrator = parse_config(RLConfig, ["--orchestrator.rollout.timeout-s", "60"]).orchestrator
    assert type(orchestrator.rollout) is type(config.rollout) and orchestrator.rollout.timeout_s == 60


def test_training_sampling_refuses_truncation_and_eval_sampling_keeps_it():
    from rl.eval.config import EvalCommandConfig
    from rl.orchestrator.config import OrchestratorConfig

    for flag, field in (("--sampling.top-p", "top_p"), ("--sampling.top-k", "top_k"), ("--sampling.min-p", "min_p")):
        value = "50" if field == "top_k" else "0.5"
        with pytest.raises(ConfigError, match=f"sampling.{field} = .*full softmax"):
            parse_config(OrchestratorConfig, [flag, value])
        assert parse_config(OrchestratorConfig, ["--eval." + flag[2:], value])  # the periodic eval may truncate
    config = parse_config(EvalCommandConfig, ["--sampling.top-p", "0.9", "--sampling.top-k", "50",
                                              "--sampling.min-p", "0.05"])
    assert (config.sampling.top_p, config.sampling.top_k, config.sampling.min_p) == (0.9, 50, 0.05)
    assert parse_config(OrchestratorConfig, ["--sampling.top-k", "-1", "--sampling.top-p", "1"])  # no truncation


def test_an_explicit_kv_cache_reaches_vllm_in_bytes():
    from rl.inference.config import InferenceConfig
    from rl.inference.server import vllm_argv

    argv = vllm_argv(InferenceConfig(dtype="auto", kv_cache_gib=0.25), "/m", 0.2, [])
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(2**28)
    assert "--kv-cache-memory-bytes" not in vllm_argv(InferenceConfig(dtype="auto"), "/m", 0.2, [])
    with pytest.raises(ConfigError, match="kv_cache_gib"):
        parse_config(RLConfig, ["--inference.kv-cache-gib", "0"])


def test_a_mask_against_rescored_makes_the_orchestrator_rescore_at_temperature_one_only():
    mask = '[{"type": "geo_mask", "against": "rescored"}]'
    config, _ = load(["--trainer.loss.mismatch", mask])
    assert config.orchestrator.rescore is True
    assert load([])[0].orchestrator.rescore is False
    with pytest.raises(ConfigError, match="prompt logprobs are untempered"):
        load(["--trainer.loss.mismatch", mask, "--orchestrator.sampling.temperature", "0.7"])
    with pytest.raises(ConfigError, match="contradicts orchestrator.rescore"):
        load(["--orchestrator.rescore", "true"])
