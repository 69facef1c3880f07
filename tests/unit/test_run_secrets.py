"""The run's secrets stay where they are needed: no config dump, print-out, W&B record or record file holds one; the
run directory is its user's alone; a secret given on a command line (every local user's `ps` shows it) is warned
about. (The 0600 configs the processes read theirs from: test_bad_input.py.)"""

import logging
import os
import stat

from typing import get_args

import pytest
from pydantic import BaseModel

from rl.config import SECRET, SECRET_MASK, is_secret, parse_config, public_config, run_cli, to_toml
from rl.envs.config import EnvServerConfig
from rl.inference.config import InferenceConfig
from rl.launcher import main as launcher
from rl.launcher.config import RLConfig
from rl.metrics import MetricsLogger
from rl.orchestrator.config import OrchestratorConfig
from rl.protocol import RunPaths
from rl.trainer.config import TrainerConfig
from tests.unit.test_bad_input import fails, refuse_to_start, rl_argv  # noqa: F401 (fixtures; `model` is conftest's)

TRANSFER_SECRET = "transfer-s3cret-" + "t" * 16
ADMIN_TOKEN = "admin-s3cret-token"
API_KEY = "api-s3cret-key"
ENV_SECRET = "env-server-s3cret-" + "e" * 8
SECRETS = (TRANSFER_SECRET, ADMIN_TOKEN, API_KEY, ENV_SECRET)


def trainer_config() -> TrainerConfig:
    return parse_config(TrainerConfig, ["--transfer.type", "collective", "--transfer.secret", TRANSFER_SECRET])


def orchestrator_config() -> OrchestratorConfig:
    env = f'[{{"id": "reverse-text", "address": "tcp://10.0.0.2:5000", "secret": "{ENV_SECRET}"}}]'
    return parse_config(OrchestratorConfig, ["--client.admin-token", ADMIN_TOKEN, "--env", env])


def inference_config() -> InferenceConfig:
    return parse_config(InferenceConfig, ["--admin-token", ADMIN_TOKEN, "--api-key", API_KEY, "--transfer.type",
                                          "collective", "--transfer.secret", TRANSFER_SECRET])


def env_server_config() -> EnvServerConfig:
    return parse_config(EnvServerConfig, ["--env.id", "reverse-text", "--address", "tcp://0.0.0.0:5000",
                                          "--secret", ENV_SECRET])


CONFIGS = [trainer_config, orchestrator_config, inference_config, env_server_config]


def leaked(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


@pytest.mark.parametrize("make", CONFIGS, ids=lambda make: make.__name__)
def test_no_dump_or_print_out_of_a_config_holds_its_secrets(make):
    config = make()
    assert leaked(str(public_config(config))) == []
    assert leaked(to_toml(config, mask_secrets=True)) == []
    assert leaked(repr(config)) == [] and leaked(str(config)) == []
    assert SECRET_MASK in str(public_config(config))  # still shown as set


@pytest.mark.parametrize("make", CONFIGS, ids=lambda make: make.__name__)
def test_a_plain_model_dump_hides_every_secret(make):
    """By construction: whoever dumps a config for display gets no secret it does not ask for."""
    config = make()
    assert leaked(str(config.model_dump(mode="json"))) == [] and leaked(str(config.model_dump())) == []
    assert leaked(to_toml(config)) != []  # what the processes read back (written 0600): the real values


@pytest.mark.parametrize("make", CONFIGS, ids=lambda make: make.__name__)
def test_the_config_a_process_reads_back_keeps_its_secrets(make, tmp_path):
    config = make()
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    assert parse_config(type(config), ["@", str(path)]) == config


def secret_like(name: str) -> bool:
    words = name.split("_")
    return bool({"secret", "token", "password", "key"} & set(words)) and words[-1] not in ("id", "var")


def typed_secret(field) -> bool:
    def marked(annotation) -> bool:
        return any(arg is SECRET or marked(arg) for arg in get_args(annotation))

    return any(m is SECRET for m in field.metadata) or marked(field.annotation)


def untyped_secrets(cls, prefix="") -> list[str]:
    """The fields named like secrets in `cls` and its sections that are not typed `Secret`."""
    found = []
    for name, field in cls.model_fields.items():
        if secret_like(name) and not typed_secret(field):
            assert is_secret(name, field), f"{prefix}{name} is hidden nowhere"
            found.append(prefix + name)
        stack = [field.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                found += untyped_secrets(tp, f"{prefix}{name}.")
            else:
                stack += get_args(tp)
    return found


def test_every_field_named_like_a_secret_is_typed_secret():
    untyped = set(untyped_secrets(RLConfig)) | set(untyped_secrets(EnvServerConfig))
    assert untyped == set()


def test_wandb_records_no_secret(tmp_path):
    """Offline W&B writes what the online project would get: the run's config, without a secret in any file."""
    paths = RunPaths(tmp_path)
    for process, config in (("trainer", trainer_config()), ("orchestrator", orchestrator_config())):
        config.wandb.project, config.wandb.mode = "rl-test", "offline"
        metrics = MetricsLogger(process, paths, config.wandb, config, logging.getLogger("test"))
        metrics.log(0, {"loss": 0.5}, ("loss",))
        metrics.close()
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file()]
    records = [p for p in files if p.suffix == ".wandb"]
    assert len(records) == 2 and all(SECRET_MASK.encode() in p.read_bytes() for p in records)  # the config is there
    assert [(p.name, leaked(p.read_bytes().decode(errors="replace"))) for p in files
            if leaked(p.read_bytes().decode(errors="replace"))] == []


def test_the_record_of_the_run_config_holds_no_secret(model, tmp_path, monkeypatch, refuse_to_start):  # noqa: F811
    """configs/rl.toml is a record nothing reads back; the processes' own configs keep what they need."""
    monkeypatch.setenv("RL_INFERENCE__ADMIN_TOKEN", ADMIN_TOKEN)
    with pytest.raises(AssertionError, match="started despite"):
        launcher.main(rl_argv(model, tmp_path / "run"))
    configs = tmp_path / "run" / "configs"
    assert leaked((configs / "rl.toml").read_text()) == []
    assert ADMIN_TOKEN in (configs / "inference.toml").read_text()


def test_the_run_directory_is_its_users_alone(model, tmp_path, refuse_to_start):  # noqa: F811
    with pytest.raises(AssertionError, match="started despite"):
        launcher.main(rl_argv(model, tmp_path / "new" / "run"))
    assert stat.S_IMODE((tmp_path / "new" / "run").stat().st_mode) == 0o700
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    with pytest.raises(AssertionError, match="started despite"):
        launcher.main(rl_argv(model, existing))
    assert stat.S_IMODE(existing.stat().st_mode) == 0o700


def test_a_process_started_by_hand_makes_its_run_directory_private(tmp_path):
    """The trainer and the orchestrator make it so before they write anything (W&B's files among them)."""
    paths = RunPaths(tmp_path / "run")
    paths.make_private()
    assert stat.S_IMODE(paths.root.stat().st_mode) == 0o700
    os.chmod(paths.root, 0o751)
    paths.make_private()
    assert stat.S_IMODE(paths.root.stat().st_mode) == 0o700


def test_a_secret_on_the_command_line_is_warned_about_without_being_repeated(capsys):
    run_cli(EnvServerConfig, ["--env.id", "reverse-text", "--address", "tcp://0.0.0.0:5000", "--secret", ENV_SECRET])
    err = capsys.readouterr().err
    assert "--secret" in err and "RL_ENV_SERVER__SECRET" in err and "ps" in err, err
    assert ENV_SECRET not in err
    run_cli(EnvServerConfig, ["--env.id", "reverse-text", "--address", "tcp://127.0.0.1:5000"])
    assert capsys.readouterr().err == ""


def test_the_launcher_warns_about_a_secret_on_its_command_line(model, tmp_path, capsys):  # noqa: F811
    launcher.main(rl_argv(model, tmp_path / "run") + ["--dry-run", "--inference.admin-token", ADMIN_TOKEN])
    err = capsys.readouterr().err
    assert "--inference.admin-token" in err and "RL_INFERENCE__ADMIN_TOKEN" in err and ADMIN_TOKEN not in err, err


def test_an_error_about_a_secret_does_not_repeat_it(model, tmp_path, capsys, monkeypatch, refuse_to_start):  # noqa: F811
    """Contradicting secrets are refused, the message naming the fields, not their values (it lands in logs)."""
    monkeypatch.setenv("RL_INFERENCE__ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("RL_ORCHESTRATOR__CLIENT__ADMIN_TOKEN", "another-s3cret-token")
    err = fails(rl_argv(model, tmp_path / "run"), capsys)
    assert "contradicts" in err and "admin_token" in err and not leaked(err) and "another-s3cret" not in err, err
    monkeypatch.delenv("RL_ORCHESTRATOR__CLIENT__ADMIN_TOKEN")
    for process, secret in (("TRAINER", TRANSFER_SECRET), ("INFERENCE", "another-s3cret-" + "x" * 16)):
        monkeypatch.setenv(f"RL_{process}__TRANSFER__TYPE", "collective")
        monkeypatch.setenv(f"RL_{process}__TRANSFER__SECRET", secret)
    err = fails(rl_argv(model, tmp_path / "run"), capsys)
    assert "transfer differs" in err and not leaked(err) and "another-s3cret" not in err, err


def test_secrets_in_vllm_extra_args_are_masked_wherever_configs_and_commands_are_shown(model, tmp_path, capsys):  # noqa: F811
    """`--hf-token hf_...` given through inference.extra_args: the process's own config keeps it (vLLM needs it), the
    dry run's configs and commands, the run's record and the report do not; other flags stay as they are."""
    from rl.config_secrets import args_without_secrets

    args = ["--hf-token", "hf_Secr3tValue", "--max-num-batched-tokens", "512", "--ssl-keyfile=/k/server.key",
            "--hf_token=hf_0ther"]
    assert args_without_secrets(args) == ["--hf-token", SECRET_MASK, "--max-num-batched-tokens", "512",
                                          "--ssl-keyfile=/k/server.key", f"--hf_token={SECRET_MASK}"]
    config = InferenceConfig(extra_args=args)
    assert "hf_Secr3tValue" in to_toml(config) and "hf_Secr3tValue" not in to_toml(config, mask_secrets=True)
    launcher.main(rl_argv(model, tmp_path / "run") + ["--dry-run", "--inference.extra-args",
                                                       '["--hf-token", "hf_Secr3tValue"]'])
    out = capsys.readouterr().out
    assert "--hf-token" in out and "hf_Secr3tValue" not in out


def test_secrets_in_an_environments_free_form_tables_are_masked_by_name():
    """[[env]] args (and harness, runtime, overrides) are the environment's own keys: `judge_api_key`, `hf_token` at
    any depth are masked wherever configs are shown; other keys, `max_tokens` among them, stay."""
    from rl.envs.config import EnvConfig

    env = EnvConfig(id="reverse-text", args={"judge_api_key": "sk-Zz9", "max_tokens": 7,
                                             "judge": {"hf-token": "hf_Qq1", "models": ["a"]}})
    shown = to_toml(env, mask_secrets=True)
    assert "sk-Zz9" not in shown and "hf_Qq1" not in shown and "max_tokens = 7" in shown and SECRET_MASK in shown
    assert "sk-Zz9" in to_toml(env)  # the process that runs the environment still reads it
