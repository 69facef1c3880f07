"""Bad input to `rl`: every case fails before anything starts, with an error naming the problem, and leaves
run directories as they were. (Bad admin requests to inference are in tests/integration/test_inference.py.)"""

import json
from pathlib import Path

import pytest

from rl.launcher import main as launcher
from rl.protocol import RunPaths, append_metrics, mark_stable
from tests.conftest import ROOT

CONFIGS = ROOT / "configs" / "reverse_text"


@pytest.fixture
def model(tmp_path) -> Path:
    """Enough of a model directory for the launcher's checks (nothing is loaded before the start)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return path


@pytest.fixture
def existing_run(tmp_path) -> Path:
    """A run directory with two steps done and a complete checkpoint at step 2."""
    paths = RunPaths(tmp_path / "existing")
    for step in (0, 1):
        append_metrics(paths, {"step": step, "process": "trainer", "loss": 0.5})
    for part in ("trainer", "orchestrator"):
        directory = paths.checkpoint(2) / part
        directory.mkdir(parents=True)
        (directory / "state.bin").write_bytes(b"state")
        mark_stable(directory, step=2)
    return paths.root


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def write(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def rl_argv(model: Path, out: Path, orch: str | None = None, trainer: str | None = None) -> list[str]:
    return [
        "--trainer", "@", trainer or str(CONFIGS / "train.toml"),
        "--orchestrator", "@", orch or str(CONFIGS / "orch.toml"),
        "--inference", "@", str(CONFIGS / "infer.toml"),
        "--model.name", str(model), "--output-dir", str(out), "--max-steps", "5",
    ]


# (case id, extra flags, text the error must contain)
FLAG_CASES = [
    ("unknown-flag", ["--max-stepz", "5"], "max_stepz"),
    ("unknown-nested-flag", ["--trainer.optim.lrr", "1"], "optim.lrr"),
    ("not-an-int", ["--max-steps", "five"], "max_steps"),
    ("zero-steps", ["--max-steps", "0"], "max_steps"),
    ("negative-async-level", ["--async-level", "-1"], "async_level"),
    ("tiny-seq-len", ["--seq-len", "4"], "seq_len"),
    ("negative-lr", ["--trainer.optim.lr", "-1"], "optim.lr"),
    ("unknown-schedule", ["--trainer.optim.schedule", "exponential"], "schedule"),
    ("unknown-loss-norm", ["--trainer.loss.norm.type", "mean"], "norm"),
    ("zero-micro-batch", ["--trainer.micro-batch-size", "0"], "micro_batch_size"),
    ("negative-temperature", ["--orchestrator.sampling.temperature", "-0.5"], "temperature"),
    ("greedy-training", ["--orchestrator.sampling.temperature", "0"], "temperature must be > 0 for training"),
    ("top-p-above-one", ["--orchestrator.sampling.top-p", "1.5"], "top_p"),
    ("zero-max-tokens", ["--orchestrator.sampling.max-tokens", "0"], "max_tokens"),
    ("batch-not-multiple-of-group", ["--orchestrator.batch-size", "30"], "batch_size"),
    ("unknown-advantage", ["--orchestrator.advantage.type", "ppo"], "advantage"),
    ("port-out-of-range", ["--inference.port", "70000"], "port"),
    ("unknown-dtype", ["--inference.dtype", "float8"], "dtype"),
    ("memory-share-above-one", ["--inference.gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    ("zero-replicas", ["--inference-replicas", "0"], "inference_replicas"),
    ("gpu-flags-on-cpu", ["--trainer-gpus", "1"], "no GPU is visible"),
    ("zero-ckpt-interval", ["--ckpt.interval", "0"], "interval"),
    ("keep-too-few-weights", ["--async-level", "2", "--trainer.keep-weights", "3"], "keep_weights"),
    ("missing-flag-value", ["--max-steps"], "max_steps: Input should be a valid integer, unable to parse string as an integer (a flag given without a value"),
    ("stray-argument", ["oops"], "oops"),
    ("resume-step-zero", ["--resume-step", "0"], "resume_step"),
    ("resume-without-checkpoint", ["--resume"], "no complete checkpoint"),
]


@pytest.fixture
def refuse_to_start(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("the run was started despite bad input")

    monkeypatch.setattr(launcher.Supervisor, "run", started)


def fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.startswith("rl: error:"), err
    return err


@pytest.mark.parametrize("extra, named", [c[1:] for c in FLAG_CASES], ids=[c[0] for c in FLAG_CASES])
def test_bad_flags(extra, named, model, tmp_path, capsys, refuse_to_start):
    out = tmp_path / "run"
    assert named in fails(rl_argv(model, out) + extra, capsys)
    assert not out.exists(), "a failed start wrote into the output directory"


FILE_CASES = [
    ("missing-file", None, "does not exist"),
    ("toml-syntax", "batch_size = = 3\n", "not valid TOML"),
    ("unknown-field", "batch_sise = 32\n", "batch_sise"),
    ("unknown-nested-field", "[sampling]\ntemprature = 1.0\n", "sampling.temprature"),
    ("wrong-type", "batch_size = 'many'\n", "batch_size"),
    ("env-not-installed", "[[env]]\nid = 'no-such-env'\n", "no-such-env"),
    ("env-unknown-arg", "[[env]]\nid = 'reverse-text'\nargs = { lenght = 3 }\n", "lenght"),
    ("env-bad-arg-value", "[[env]]\nid = 'reverse-text'\nargs = { min_len = 9, max_len = 3 }\n", "min_len"),
    ("env-zero-ratio", "[[env]]\nid = 'reverse-text'\nratio = 0\n", "ratio"),
    ("env-without-id", "[[env]]\nargs = { min_len = 3 }\n", "env.0.id"),
    ("eval-env-not-installed", "[eval]\ninterval = 2\n[[eval.env]]\nid = 'nope-env'\n", "eval.env[0]"),
    ("env-not-installed-says-how", "[[env]]\nid = 'no-such-env'\n", "uv pip install"),
    ("env-unknown-harness", "[[env]]\nid = 'reverse-text'\nharness = { id = 'no-such-harness' }\n",
     "orchestrator.env[0]: environment 'reverse-text': harness.id: harness 'no-such-harness' not found"),
    ("env-harness-field", "[[env]]\nid = 'reverse-text'\nharness = { id = 'null', colour = 1 }\n", "harness.colour"),
    ("env-unknown-runtime", "[[env]]\nid = 'reverse-text'\nruntime = { type = 'cloud' }\n", "runtime: Input tag 'cloud'"),
    ("env-remote-runtime-offline", "[[env]]\nid = 'reverse-text'\nruntime = { type = 'prime' }\n", "Prime credentials"),
    ("env-unknown-seat", "[[env]]\nid = 'reverse-text'\n[env.overrides.solver]\nmax_turns = 2\n", "overrides.solver"),
    ("env-duplicate-label", "[[env]]\nid = 'reverse-text'\n[[env]]\nid = 'reverse-text'\n", "distinct `name`"),
    ("eval-greedy-pass-at-k", "[eval]\ninterval = 2\nrollouts_per_example = 4\n", "set sampling.temperature > 0"),
]


@pytest.mark.parametrize("text, named", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_bad_orchestrator_files(text, named, model, tmp_path, capsys, refuse_to_start, monkeypatch):
    monkeypatch.delenv("PRIME_API_KEY", raising=False)  # a remote sandbox is refused for want of credentials
    monkeypatch.setenv("HOME", str(tmp_path))
    orch = str(tmp_path / "missing.toml") if text is None else write(tmp_path, "orch.toml", text)
    out = tmp_path / "run"
    assert named in fails(rl_argv(model, out, orch=orch), capsys)
    assert not out.exists()


def test_bad_trainer_file(model, tmp_path, capsys, refuse_to_start):
    trainer = write(tmp_path, "train.toml", "[loss]\neps_low = -0.2\n")
    assert "eps_low" in fails(rl_argv(model, tmp_path / "run", trainer=trainer), capsys)


def model_cases(tmp_path: Path) -> list[tuple[str, str]]:
    (tmp_path / "models").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    return [
        (str(tmp_path / "no-such-model"), "does not exist"),
        (str(tmp_path / "empty"), "no config.json"),
        (str(tmp_path / "weights.bin"), "not a Hugging Face model directory"),
        (str(tmp_path / "models" / "typo"), "does not exist"),
        ("./models/typo", "does not exist"),
        ("org/name/extra", "does not exist"),
    ]


def test_bad_model_paths(tmp_path, capsys, refuse_to_start, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, named in model_cases(tmp_path):
        err = fails(rl_argv(Path(name), tmp_path / "run"), capsys)
        assert named in err and str(Path(name)) in err, (name, err)


def test_output_dir_of_another_run_is_refused_and_untouched(model, existing_run, capsys, refuse_to_start):
    before = snapshot(existing_run)
    assert "already holds a run" in fails(rl_argv(model, existing_run), capsys)
    # resuming it at a checkpoint that is not there, or already past --max-steps
    assert "complete checkpoints are [2]" in fails(rl_argv(model, existing_run) + ["--resume-step", "3"], capsys)
    past = rl_argv(model, existing_run)[:-2] + ["--max-steps", "2", "--resume"]
    assert "already at --max-steps 2" in fails(past, capsys)
    assert snapshot(existing_run) == before


def test_output_dir_that_is_a_file(model, tmp_path, capsys, refuse_to_start):
    out = tmp_path / "run"
    out.write_text("not a directory")
    assert "is not a directory" in fails(rl_argv(model, out), capsys)
    assert out.read_text() == "not a directory"


def test_damaged_checkpoint_is_refused_and_untouched(model, existing_run, capsys, refuse_to_start):
    state = existing_run / "checkpoints" / "step_2" / "trainer" / "state.bin"
    state.write_bytes(b"stat")
    before = snapshot(existing_run)
    assert "state.bin has 4 bytes" in fails(rl_argv(model, existing_run) + ["--resume"], capsys)
    assert snapshot(existing_run) == before
