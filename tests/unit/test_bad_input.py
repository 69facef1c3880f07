"""Bad input to `rl`: every case fails before anything starts, with an error naming the problem, and leaves
run directories as they were; malformed markers, batches and checkpoints are refused by their readers, naming
the problem, and run no code. (Bad requests to a real inference server: tests/integration/test_bad_requests.py.)"""

import re
from pathlib import Path

import pytest

from rl.launcher import main as launcher
from rl.protocol import RunPaths, append_metrics, mark_stable
from tests.conftest import ROOT

CONFIGS = ROOT / "configs" / "reverse_text"


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
    ("bf16-trainer-on-cpu", ["--trainer.dtype", "bfloat16"], "trainer.dtype = 'bfloat16' needs a GPU"),
    ("keep-too-few-weights", ["--async-level", "2", "--trainer.keep-weights", "3"], "keep_weights"),
    ("missing-flag-value", ["--max-steps"],
     "max_steps: Input should be a valid integer, unable to parse string as an integer "
     "(a flag given without a value"),
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
    ("env-unknown-runtime", "[[env]]\nid = 'reverse-text'\nruntime = { type = 'cloud' }\n",
     "runtime: Input tag 'cloud'"),
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


def test_a_hub_looking_name_that_is_neither_here_nor_on_the_hub_is_refused(monkeypatch, tmp_path):
    """The README's `rl` command before `tiny-model` built models/tiny: refused at start, naming both readings."""
    monkeypatch.chdir(tmp_path)  # where no models/tiny was built
    import huggingface_hub
    from huggingface_hub.utils import RepositoryNotFoundError

    from rl.config import ConfigError
    from rl.checks import check_model

    def no_such_model(name, timeout):
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an HTTP response
        Exception.__init__(error, f"{name} not found")
        raise error

    with pytest.raises(ConfigError, match=r"neither a local directory .* nor a model on the Hugging Face hub.*"
                                          r"uv run tiny-model --out models/tiny"):
        check_model("models/tiny")  # offline here: the hub is unreachable, and it is not cached
    monkeypatch.setattr(huggingface_hub, "model_info", no_such_model)
    with pytest.raises(ConfigError, match="the hub has no such model"):
        check_model("models/tiny")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda name, file: f"/cache/{name}/{file}")
    check_model("Qwen/Qwen3-0.6B")  # in the local cache: vLLM loads it offline


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


# ---- STABLE markers a reader must refuse, not crash on (run as the inference server, trainer, orchestrator
# and `rl --resume` read them) ----

MARKER_CASES = [
    ("not-json", b"{oops", "not valid JSON"),
    ("not-utf8", b'{"files": "\xff\xfe"}', "not UTF-8"),
    ("not-an-object", b"[1, 2]", "not a JSON object"),
    ("files-not-an-object", b'{"files": [["state.bin", 64]]}', "`files` is list, not an object"),
    ("entry-not-an-object", b'{"files": {"state.bin": 64}}', "entry 'state.bin' is not an object"),
    ("entry-without-bytes", b'{"files": {"state.bin": {"crc32": 1}}}',
     "entry 'state.bin' lacks a non-negative integer `bytes`"),
    ("bytes-not-an-int", b'{"files": {"state.bin": {"bytes": "64", "crc32": 1}}}',
     "lacks a non-negative integer `bytes`"),
    ("files-null", b'{"step": 4, "files": null}', "`files` is NoneType, not an object"),
    ("files-absent", b'{"step": 4}', "`files` is NoneType, not an object"),
    ("nested-deeply", b'{"files": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested too deeply"),
    ("huge-integer", b'{"files": {"state.bin": {"bytes": ' + b"9" * 5000 + b', "crc32": 1}}}', "not valid JSON"),
    ("name-over-255-bytes", b'{"files": {"' + b"x" * 300 + b'": {"bytes": 1, "crc32": 1}}}', "a name over 255 bytes"),
    ("lone-surrogate", b'{"files": {"\\ud800.bin": {"bytes": 1, "crc32": 1}}}', "not valid UTF-8"),
    ("negative-bytes", b'{"files": {"state.bin": {"bytes": -1, "crc32": 1}}}', "lacks a non-negative integer `bytes`"),
    ("absolute-name", b'{"files": {"/etc/hostname": {"bytes": 1, "crc32": 1}}}',
     "lists '/etc/hostname', which is outside"),
    ("parent-name", b'{"files": {"../../outside.bin": {"bytes": 1, "crc32": 1}}}',
     "lists '../../outside.bin', which is outside"),
]


@pytest.mark.parametrize("content, named", [c[1:] for c in MARKER_CASES], ids=[c[0] for c in MARKER_CASES])
def test_a_malformed_marker_is_a_corrupt_directory(content, named, tmp_path):
    from rl.protocol import CorruptFileError, verify_stable

    (tmp_path / "outside.bin").write_bytes(b"x")
    directory = tmp_path / "a" / "b"
    directory.mkdir(parents=True)
    (directory / "state.bin").write_bytes(bytes(64))
    (directory / "STABLE").write_bytes(content)
    with pytest.raises(CorruptFileError, match=re.escape(named)):
        verify_stable(directory)


def test_a_marker_that_is_a_directory_is_a_corrupt_directory(tmp_path):
    from rl.protocol import CorruptFileError, verify_stable

    (tmp_path / "STABLE").mkdir()
    with pytest.raises(CorruptFileError, match="STABLE is not a regular file"):
        verify_stable(tmp_path)


@pytest.mark.parametrize("content", [c[1] for c in MARKER_CASES], ids=[c[0] for c in MARKER_CASES])
def test_resume_skips_a_checkpoint_with_a_malformed_marker(content, model, existing_run, capsys, refuse_to_start):
    paths = RunPaths(existing_run)
    for part in ("trainer", "orchestrator"):  # a newer checkpoint, step 4, whose trainer marker is malformed
        (paths.checkpoint(4) / part).mkdir(parents=True)
        (paths.checkpoint(4) / part / "state.bin").write_bytes(b"state")
        mark_stable(paths.checkpoint(4) / part, step=4)
    (paths.checkpoint(4) / "trainer" / "STABLE").write_bytes(content)
    argv = rl_argv(model, existing_run)[:-2] + ["--max-steps", "6", "--resume"]
    with pytest.raises(AssertionError, match="started despite"):  # the fixture stops it once a checkpoint is chosen
        launcher.main(argv)
    out = capsys.readouterr().out
    assert "resuming from step 2" in out and "skipped damaged checkpoints: step 4" in out, out


# ---- Rollout batches the trainer must refuse, naming the field ----

def batch_tensors():
    import torch

    return {
        "input_ids": torch.arange(7, dtype=torch.int64), "loss_mask": torch.ones(7, dtype=torch.bool),
        "logprobs": torch.full((7,), -0.5), "lengths": torch.tensor([3, 4]), "advantages": torch.tensor([0.5, -0.5]),
        "rewards": torch.tensor([1.0, 0.0]), "policy_versions": torch.tensor([0, 0]),
    }


def replaced(field: str, make):
    tensors = batch_tensors()
    tensors[field] = make(tensors[field])
    return tensors


BATCH_CASES = [
    ("short-advantages", "advantages", lambda t: t[:1], "advantages has 1 entries for 2 samples"),
    ("long-rewards", "rewards", lambda t: t.repeat(2), "rewards has 4 entries for 2 samples"),
    ("short-versions", "policy_versions", lambda t: t[:1], "policy_versions has 1 entries for 2 samples"),
    ("nan-advantage", "advantages", lambda t: t.index_fill(0, t.new_tensor([0], dtype=int), float("nan")),
     "advantages holds NaN or infinity"),
    ("inf-reward", "rewards", lambda t: t.index_fill(0, t.new_tensor([1], dtype=int), float("inf")),
     "rewards holds NaN or infinity"),
    ("nan-logprob", "logprobs", lambda t: t.index_fill(0, t.new_tensor([2], dtype=int), float("nan")),
     "logprobs holds NaN or infinity"),
    ("float-input-ids", "input_ids", lambda t: t.float(), "input_ids must be int64, not torch.float32"),
    ("float-versions", "policy_versions", lambda t: t.float(), "policy_versions must be int64"),
    ("negative-length", "lengths", lambda t: t.new_tensor([-1, 8]), "lengths must be positive"),
    ("short-mask", "loss_mask", lambda t: t[:6], "loss_mask has 6 entries for 7 tokens"),
    ("missing-field", "rewards", None, "lacks rewards"),
    ("two-dimensional", "input_ids", lambda t: t.reshape(1, 7), "input_ids must be one-dimensional"),
]


@pytest.mark.parametrize("field, make, named", [c[1:] for c in BATCH_CASES], ids=[c[0] for c in BATCH_CASES])
def test_a_malformed_batch_is_refused_naming_the_field(field, make, named, tmp_path):
    from safetensors.torch import save_file

    from rl.protocol import read_batch
    from rl.samples import decode_samples

    tensors = batch_tensors()
    if make is None:
        del tensors[field]
    else:
        tensors = replaced(field, make)
    with pytest.raises(ValueError, match=re.escape(named)):
        decode_samples(tensors)
    paths = RunPaths(tmp_path)
    paths.rollouts(0).mkdir(parents=True)
    save_file(tensors, str(paths.rollout_file(0, 0)))
    mark_stable(paths.rollouts(0))
    with pytest.raises(ValueError, match=f"rollout batch .* is missing or corrupt: .*{re.escape(named)}"):
        read_batch(paths, 0, 0)


# ---- The admin token and other config gaps ----

TOKEN_CASES = [
    ("empty-admin-token", ["--inference.admin-token", ""], "admin_token"),
    ("empty-client-token", ["--orchestrator.client.admin-token", ""], "admin_token"),
    ("replica-ports-past-65535", ["--inference.port", "65535", "--inference-replicas", "2"], "65536"),
    ("tensor-parallel-flag-in-extra-args", ["--inference.extra-args", '["--tensor-parallel-size=2"]'],
     "--tensor-parallel-size=2 duplicates inference.tensor_parallel_size"),
    ("tensor-parallel-above-the-cores", ["--inference.tensor-parallel-size", "100000"],
     "inference.tensor_parallel_size = 100000 needs 100000 CPU cores per server"),
    ("empty-value", ["--max-steps="], "max_steps: Input should be a valid integer"),
    ("api-key-in-extra-args", ["--inference.extra-args", '["--api-key", "s3cret-key"]'], "set inference.api_key"),
    ("api-key-with-equals-in-extra-args", ["--inference.extra-args", '["--api-key=s3cret-key"]'],
     "set inference.api_key"),
    ("api-key-abbreviated-in-extra-args", ["--inference.extra-args", '["--api_k", "s3cret-key"]'],
     "set inference.api_key"),
]


@pytest.mark.parametrize("extra, named", [c[1:] for c in TOKEN_CASES], ids=[c[0] for c in TOKEN_CASES])
def test_config_gaps(extra, named, model, tmp_path, capsys, refuse_to_start):
    err = fails(rl_argv(model, tmp_path / "run") + extra, capsys)
    assert named in err and "JSON" not in err and "s3cret-key" not in err, err


def test_dry_run_checks_the_output_dir_and_masks_the_admin_token(model, existing_run, tmp_path, capsys):
    assert "already holds a run" in fails(rl_argv(model, existing_run) + ["--dry-run"], capsys)
    launcher.main(rl_argv(model, tmp_path / "new") + ["--dry-run", "--inference.admin-token", "s3cret-token-value"])
    out = capsys.readouterr().out
    assert "admin_token" in out and "s3cret-token-value" not in out, out


def test_the_api_key_is_masked_in_the_dry_run_and_handed_to_the_orchestrator_unprinted(
    model, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("RL_INFERENCE__API_KEY", "s3cret-api-key")
    monkeypatch.setenv("RL_INFERENCE__ADMIN_TOKEN", "s3cret-token")  # the servers named below: another host
    argv = rl_argv(model, tmp_path / "run") + ["--orchestrator.client.base-urls", '["http://u:s3cret-pw@a:8000"]']
    launcher.main(argv + ["--dry-run"])
    out = capsys.readouterr().out
    assert 'api_key = "<hidden>"' in out and "s3cret" not in out, out
    assert "http://u:<hidden>@a:8000" in out
    config, host = launcher.load(argv)
    (orchestrator,) = [s for s in launcher.child_specs(config, host, RunPaths(tmp_path / "run"))
                       if s.name == "orchestrator"]
    assert orchestrator.secret_env == {"RL_INFERENCE_API_KEY": "s3cret-api-key"}
    assert "s3cret-api-key" not in str(orchestrator.extra_env)


def test_resolved_configs_are_readable_by_their_owner_only(model, tmp_path, capsys, refuse_to_start):
    with pytest.raises(AssertionError, match="started despite"):
        launcher.main(rl_argv(model, tmp_path / "run") + ["--inference.admin-token", "s3cret-token-value"])
    configs = list((tmp_path / "run" / "configs").glob("*.toml"))  # rl's, the three processes' and an env server's
    assert len(configs) == 5 and any("s3cret-token-value" in p.read_text() for p in configs)
    assert {oct(p.stat().st_mode & 0o777) for p in configs} == {"0o600"}


# ---- Trainer checkpoints: loading one runs no code from its files (the run directory may be shared) ----


class RunsCode:
    """Unpickled, it writes a file: what a tampered checkpoint could do with the trainer's permissions."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


@pytest.fixture
def one_rank_world(monkeypatch):
    import torch.distributed as dist

    from rl.trainer.world import init_world
    from tests.integration.launched import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    world = init_world()
    yield world
    dist.destroy_process_group()


def small_training_state():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_a_tampered_checkpoint_metadata_runs_no_code(tmp_path, one_rank_world):
    import pickle

    from rl.config import CkptConfig
    from rl.trainer.checkpoint import Checkpointer

    checkpointer = Checkpointer(RunPaths(tmp_path / "run"), CkptConfig(), one_rank_world)
    model, optimizer, scheduler = small_training_state()
    checkpointer.save(2, model, optimizer, scheduler)
    checkpointer.load(2, model, optimizer, scheduler)  # a checkpoint as written loads
    directory = checkpointer.directory(2)
    marker = tmp_path / "code-ran"
    (directory / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    mark_stable(directory, step=2)  # whoever can rewrite a file of the run directory can rewrite its marker
    with pytest.raises(pickle.UnpicklingError, match="builtins.exec is not part of a checkpoint's metadata"):
        checkpointer.load(2, model, optimizer, scheduler)
    assert not marker.exists()


def test_checkpoint_metadata_pickled_by_python_3_11_2_loads_and_its_getattr_builds_only_enum_members():
    """Python 3.11.0-3.11.4 pickle an enum member as getattr(class, name): the metadata's own enum members load so,
    and nothing else does (an attribute of any other class, or a member's other attributes)."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint import metadata as dcp_metadata

    from rl.trainer.checkpoint import MetadataUnpickler

    class ByName(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, dcp_metadata._MEM_FORMAT_ENCODING):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    properties = dcp_metadata.TensorProperties(dtype=torch.float32)
    pickled = io.BytesIO()
    ByName(pickled, protocol=pickle.HIGHEST_PROTOCOL).dump(properties)
    assert b"getattr" in pickled.getvalue()
    assert MetadataUnpickler(io.BytesIO(pickled.getvalue())).load() == properties

    for cls, name in ((torch.Size, "__class__"), (dcp_metadata._MEM_FORMAT_ENCODING, "__class__"),
                      (dcp_metadata._MEM_FORMAT_ENCODING, "_member_map_")):
        hostile = io.BytesIO()
        pickle.Pickler(hostile, protocol=pickle.HIGHEST_PROTOCOL).dump(GetattrOf(cls, name))
        with pytest.raises(pickle.UnpicklingError, match="is not part of a checkpoint's metadata"):
            MetadataUnpickler(io.BytesIO(hostile.getvalue())).load()


class GetattrOf:
    """Pickles as getattr(cls, name)."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return getattr, (self.cls, self.name)


def test_a_tampered_checkpoint_value_runs_no_code(tmp_path):
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from rl.trainer.checkpoint import SafeLoadPlanner

    marker = tmp_path / "code-ran"
    value = io.BytesIO()
    torch.save(RunsCode(marker), value)
    value.seek(0)
    planner = SafeLoadPlanner()
    planner.set_up_planner({"lr": 0.1}, None, True)
    index = MetadataIndex("lr")
    item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([]), index, torch.Size([]), torch.Size([]))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        planner.load_bytes(item, value)
    assert not marker.exists()


# ---- Truncated sampling for training rollouts ----

TRUNCATED_SAMPLING_CASES = [
    ("top-p", ["--orchestrator.sampling.top-p", "0.9"], "sampling.top_p = 0.9"),
    ("top-k", ["--orchestrator.sampling.top-k", "50"], "sampling.top_k = 50"),
    ("min-p", ["--orchestrator.sampling.min-p", "0.05"], "sampling.min_p = 0.05"),
]


@pytest.mark.parametrize("extra, named", [c[1:] for c in TRUNCATED_SAMPLING_CASES],
                         ids=[c[0] for c in TRUNCATED_SAMPLING_CASES])
def test_truncated_sampling_is_refused_for_training_naming_the_field_and_why(extra, named, model, tmp_path, capsys,
                                                                            refuse_to_start):
    """vLLM's logprobs under top_p / top_k / min_p come from the renormalised distribution, the trainer scores the
    full softmax: the importance ratios would be wrong, so `rl --dry-run` refuses them before anything starts."""
    out = tmp_path / "run"
    err = fails(rl_argv(model, out) + extra + ["--dry-run"], capsys)
    assert named in err and "full softmax" in err, err
    assert not out.exists()


def test_eval_sampling_may_truncate(model, tmp_path, capsys):
    """The orchestrator's periodic eval computes no importance ratio: its sampling may use top_p, top_k, min_p."""
    launcher.main(rl_argv(model, tmp_path / "run") + ["--orchestrator.eval.sampling.top-p", "0.9",
                                                      "--orchestrator.eval.sampling.top-k", "50",
                                                      "--orchestrator.eval.sampling.min-p", "0.05", "--dry-run"])
    capsys.readouterr()
