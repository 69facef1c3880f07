"""Any verifiers environment loads as an [[env]] table says: a Taskset-only package runs on rl's in-process
harness and the local runtime, the user's harness/runtime/overrides reach verifiers, and every error names
the environment and the [[env]] key that caused it."""

import sys

import pytest

from rl.envs.config import EnvConfig
from rl.orchestrator.config import OrchestratorConfig
from rl.envs.loading import EnvLoadError, load_environment, load_environments
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "environments"


@pytest.fixture(autouse=True)
def test_packages(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


@pytest.fixture
def no_prime_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("PRIME_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.prime/config.json


def load(**spec):
    return load_environment(EnvConfig(**spec))


def test_a_taskset_only_package_runs_on_rls_harness_and_the_local_runtime():
    env = load(id="taskset-only", args={"num_examples": 5})
    agent = env.env.config.agent
    assert (agent.harness.id, agent.runtime.type) == ("in-process-chat", "subprocess")
    assert env.num_tasks == 5 and env.name == "taskset-only"
    assert "harness 'in-process-chat' (rl's default" in env.describe()
    assert "runtime 'subprocess' (rl's default: the environment's 'prime' is a remote sandbox)" in env.describe()


def test_an_environments_own_harness_and_runtime_are_kept():
    env = load(id="reverse-text", args={"num_examples": 2})
    agent = env.env.config.agent
    assert (agent.harness.id, agent.runtime.type) == ("reverse-text", "subprocess")
    assert "rl's default" not in env.describe()


def test_the_users_harness_runtime_and_overrides_reach_verifiers(no_prime_credentials):
    env = load(id="taskset-only", harness={"id": "null"}, runtime={"type": "docker", "image": "python:3.11"},
               overrides={"agent": {"max_turns": 3}, "timeout": {"episode": 60}}, name="echo")
    config = env.env.config
    seats = (config.agent.harness.id, config.agent.runtime.type, config.agent.runtime.image)
    assert seats == ("null", "docker", "python:3.11")
    assert (config.agent.max_turns, config.timeout.episode, env.name) == (3, 60, "echo")
    assert "harness 'null' (as configured), runtime 'docker' (as configured)" in env.describe()
    per_seat = load(id="taskset-only", overrides={"agent": {"harness": {"id": "bash"}}})
    assert per_seat.env.config.agent.harness.id == "bash"  # a built-in harness is the user's to choose


# (case id, [[env]] fields, what the error must name)
BAD = [
    ("unknown-harness", {"harness": {"id": "no-such-harness"}}, "harness.id: harness 'no-such-harness' not found"),
    ("unknown-seat-harness", {"overrides": {"agent": {"harness": {"id": "nope"}}}}, "overrides.agent.harness.id:"),
    ("harness-field", {"harness": {"id": "in-process-chat", "colour": 1}}, "harness.colour: Extra inputs"),
    ("runtime-type", {"runtime": {"type": "cloud"}}, "runtime: Input tag 'cloud'"),
    ("runtime-field", {"runtime": {"type": "docker", "colour": 1}}, "runtime.colour: Extra inputs"),
    ("taskset-arg", {"args": {"num_examples": "many"}}, "args.num_examples: Input should be a valid integer"),
    ("unknown-arg", {"args": {"num_exampels": 3}}, "args.num_exampels: Extra inputs"),
    ("unknown-seat", {"overrides": {"solver": {"max_turns": 2}}}, "overrides.solver: Extra inputs"),
    ("seat-field", {"overrides": {"agent": {"max_turns": "x"}}}, "overrides.agent.max_turns: Input should be"),
    ("taskset-in-overrides", {"overrides": {"taskset": {"num_examples": 3}}}, "set the taskset's fields in `args`"),
    ("seat-not-a-table", {"overrides": {"agent": 5}}, "overrides.agent: give a table of the seat's fields"),
    ("harness-twice", {"harness": {"id": "null"}, "overrides": {"agent": {"harness": {"id": "bash"}}}},
     "both `harness` and `overrides.agent.harness` are set"),
    ("unknown-env-class", {"overrides": {"id": "no-such-env-class"}}, "overrides.id: environment 'no-such-env-class'"),
    ("needs-a-container", {"harness": {"id": "browser_use"}}, "needs a container runtime"),
    ("remote-without-credentials", {"runtime": {"type": "prime"}},
     "seat 'agent' on 'prime' runs in a remote sandbox, which reaches this host's model through a Prime tunnel"),
]


@pytest.mark.parametrize("fields, named", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_settings_name_the_key(fields, named, no_prime_credentials):
    with pytest.raises(EnvLoadError) as error:
        load(id="taskset-only", **fields)
    assert str(error.value).startswith("environment 'taskset-only'"), error.value
    assert named in str(error.value)


def test_an_id_that_is_not_installed_says_how_to_install_it():
    with pytest.raises(EnvLoadError, match="'no-such-env' is not installed.*uv pip install"):
        load(id="no-such-env")
    with pytest.raises(EnvLoadError, match=r"env\[1\]: environment 'no-such-env' is not installed"):
        load_environments([EnvConfig(id="reverse-text"), EnvConfig(id="no-such-env")], "env")


def test_a_missing_dependency_is_not_reported_as_a_missing_environment(tmp_path, monkeypatch):
    package = tmp_path / "needs_a_dependency"
    package.mkdir()
    (package / "__init__.py").write_text("import a_dependency_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvLoadError, match="imports 'a_dependency_nobody_installed', which is not installed"):
        load(id="needs-a-dependency")
    sys.modules.pop("needs_a_dependency", None)


def test_two_environments_need_distinct_labels():
    twice = [{"id": "reverse-text"}, {"id": "reverse-text", "args": {"seed": 1}}]
    with pytest.raises(ValueError, match="two environments are labelled 'reverse-text'"):
        OrchestratorConfig(env=twice)
    named = OrchestratorConfig(env=[twice[0], twice[1] | {"name": "reverse-text-1"}])
    assert [e.label for e in named.env] == ["reverse-text", "reverse-text-1"]
