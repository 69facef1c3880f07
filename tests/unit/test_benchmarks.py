"""Every benchmark in benchmarks/ still runs at the head, checked as cheaply as each allows: all its imports resolve
(those inside its functions too), its `--help` parses, the command lines it hands rl's launcher and trainer are
accepted (`--dry-run`, or the trainer's config parsed), and where a part runs in seconds it runs at its smallest
setting. A real run of the rest needs an inference server or torchrun, minutes each: those keep to their set-up here."""

import json
import ast
import importlib
import os
import re
import runpy
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURE_ENVIRONMENTS, ROOT

BENCHMARKS = ROOT / "benchmarks"
FILES = sorted(p.name for p in BENCHMARKS.glob("*.py"))
HELPERS = {"slow_link.py"}  # imported by weight_sync.py; no command of its own
OTHER_INTERPRETER = {"trl_grpo.py": {"trl", "datasets"}}  # run by trl_side_by_side.py with TRL's own venv
LAUNCHER = [sys.executable, "-m", "rl.launcher.main"]


@pytest.fixture(autouse=True)
def benchmark_process(monkeypatch):
    """What a benchmark finds when run as a script (the repository, benchmarks/ and the fixture environments
    importable), and what it changes of this process (sys.path, os.environ) undone after."""
    monkeypatch.setattr(sys, "path", [str(ROOT), str(BENCHMARKS), str(FIXTURE_ENVIRONMENTS), *sys.path])
    environ = os.environ.copy()
    yield
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


def benchmark(name: str):
    return importlib.import_module(f"benchmarks.{name}")


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every import statement in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            assert node.level == 0, f"{path.name}: relative import"
            found.append((node.module, [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("name", FILES)
def test_every_import_resolves(name):
    """Imports inside a benchmark's functions run only minutes into a real run: each one is resolved here."""
    missing = []
    for module, names in imports(BENCHMARKS / name):
        if module.split(".")[0] in OTHER_INTERPRETER.get(name, ()):
            continue
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module}: {e}")
            continue
        for attr in names:
            if not hasattr(imported, attr) and importlib.util.find_spec(f"{module}.{attr}") is None:
                missing.append(f"{module}.{attr}")
    assert not missing, f"benchmarks/{name} imports what is not there: {missing}"


@pytest.mark.parametrize("name", [n for n in FILES if n not in HELPERS])
def test_help(name, monkeypatch, capsys):
    """The script as `python benchmarks/<name> --help` runs it: its module-level code, then its argument parser."""
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / name), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(BENCHMARKS / name), run_name="__main__")
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def parsed(module, argv: list[str]):
    """The namespace of the benchmark's own `parse_args`, given `argv`."""
    sys.argv = ["benchmark", *argv]
    return module.parse_args()


def dry_run(command: list[str], capsys) -> None:
    """rl's launcher takes `command` (as the benchmark would start it) and resolves every process's config."""
    from rl.launcher import main as launcher

    assert command[:3] == LAUNCHER, command[:3]
    launcher.main(command[3:] + ["--dry-run"])
    assert "orchestrator" in capsys.readouterr().out


def test_launcher_command_lines_of_fill_batch_distill_trl_side_by_side_and_launch_phases(model, tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.setattr(sys, "argv", sys.argv)
    fill_batch, distill, trl = benchmark("fill_batch"), benchmark("distill"), benchmark("trl_side_by_side")
    launch_phases = benchmark("launch_phases")
    dry_run(launch_phases.launch_command(parsed(launch_phases, ["--model", str(model)]), tmp_path / "launch"), capsys)
    args = parsed(fill_batch, ["--model", str(model)])
    for side, flags in fill_batch.SIDES.items():
        dry_run(fill_batch.rl_command(model, tmp_path / f"fill-{side}", args, *flags), capsys)
    args = parsed(distill, ["--top-k", "8"])
    for side, flags in distill.side_flags(args, teacher=model).items():
        dry_run(distill.rl_command(model, tmp_path / f"distill-{side}", args.steps, *flags), capsys)
    args = parsed(trl, ["--models", "tiny", "--in-process", "--async-levels", "0,1"])
    for side in trl.side_names(args):
        if side.startswith("rl-"):
            dry_run(trl.rl_command(model, trl.SHAPES["tiny"], args, tmp_path / side, side, 8123), capsys)


def test_launcher_command_lines_of_continuous(model, tmp_path, monkeypatch, capsys):
    """Both sides' command lines (the long-tail fixture environment among them) as its `--dry-run` prints them."""
    monkeypatch.setattr(sys, "argv", sys.argv)
    continuous = benchmark("continuous")
    args = parsed(continuous, ["--model", str(model), "--max-off-policy-steps", "3"])
    flags = continuous.side_flags(args)
    assert list(flags) == ["step", "continuous"] and flags["continuous"][-1] == "3"
    for side in flags:
        dry_run(continuous.rl_command(model, tmp_path / side, args, *flags[side]), capsys)
    sys.argv = ["continuous.py", "--model", str(model), "--sides", "step", "--out", str(tmp_path), "--dry-run"]
    continuous.main()
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("step: PYTHONPATH=") and "--orchestrator.dispatch step" in line
    assert not list(tmp_path.glob("step-*"))  # nothing run


def test_continuous_measures_past_the_warm_up():
    """Samples of steps 1..N-1 over step 0's record to the last one's; the largest off_policy/max."""
    steps = [{"step": i, "time": 100.0 + 10 * i, "samples": 50 + i, "rollouts/long-tail": 32, "completion_tokens": 400,
              "num_turns": 1.0 + i, "off_policy/max": i % 3, "off_policy/withheld": 4,
              "off_policy/discarded_tokens": 0.1 * i} for i in range(4)]
    result = benchmark("continuous").measure(steps)
    assert result["samples"] == 51 + 52 + 53 and result["seconds"] == 30.0
    assert result["samples_per_s"] == 156 / 30 and result["rollouts_per_s"] == 96 / 30
    assert result["staleness"] == 2 and result["in_flight"] is None
    assert result["turns"] == 3.0 and result["withheld"] == 12
    assert result["discarded"] == pytest.approx((0.1 + 0.2 + 0.3) / 3)  # steps 1..3, 400 tokens each
    with pytest.raises(RuntimeError, match="want 0..N-1"):
        benchmark("continuous").measure(steps[1:])


def after(command: list[str], module: str) -> list[str]:
    """The arguments `command` gives `python -m <module>`."""
    at = command.index(module)
    assert command[at - 1] == "-m", command
    return command[at + 1:]


def test_trainer_command_lines_of_lora_gpu_trainer_trainer_throughput_and_distills_sft(model, tmp_path, monkeypatch):
    from rl.config import parse_config
    from rl.trainer.config import TrainerConfig
    from rl.trainer.sft import SFTConfig

    monkeypatch.setattr(sys, "argv", sys.argv)
    lora, gpu_trainer = benchmark("lora"), benchmark("gpu_trainer")
    commands = [lora.trainer_command(model, tmp_path, 4, 256, lora=side) for side in (False, True)]
    sys.argv = ["gpu_trainer", "--compile"]
    commands.append(gpu_trainer.trainer_command(model, tmp_path, gpu_trainer.parse_args()))
    commands.append(benchmark("trainer_throughput").trainer_command(str(model), tmp_path, 6, 256, 2))
    configs = [parse_config(TrainerConfig, after(command, "rl.trainer.main")) for command in commands]
    assert [config.lora is not None and config.lora.rank == 16 for config in configs[:2]] == [False, True]
    assert configs[2].compile and configs[2].micro_batch_tokens == 2 * 4096
    sft = parse_config(SFTConfig, after(benchmark("distill").sft_command(model, tmp_path / "sft"), "rl.trainer.sft"))
    assert sft.output_dir == tmp_path / "sft"


def test_memory_at_its_smallest(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["memory.py", "--tokens", "32", "--hidden", "8", "--vocab", "512", "--chunk",
                                      "16", "--repeats", "1"])
    runpy.run_path(str(BENCHMARKS / "memory.py"), run_name="__main__")
    assert re.search(r"peak memory [\d.]+x naive, tokens/s [\d.]+x naive\n$", capsys.readouterr().out)


def test_cpu_owners_attributes_a_profile(tmp_path, monkeypatch, capsys):
    profile = tmp_path / "raw.txt"
    profile.write_text(
        "run (rl/orchestrator/main.py:9);validate (verifiers/v1/episode.py:3);encode (json/encoder.py:5) 6\n"
        "run (rl/orchestrator/main.py:9);render (renderers/base.py:2) 2\n"
        "run (rl/orchestrator/main.py:9);select (selectors.py:451) 40\n")  # a wait: left out
    monkeypatch.setattr(sys, "argv", ["cpu_owners.py", str(profile)])
    runpy.run_path(str(BENCHMARKS / "cpu_owners.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("8 busy samples\n") and " 75.0% verifiers\n" in out and " 25.0% renderers\n" in out


def test_trainer_throughputs_plain_loop_runs_a_step(tmp_path):
    """The floor the trainer is compared with: rl's batching, logprobs and loss in one process (also the fake
    batches lora.py and gpu_trainer.py write)."""
    from rl.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", hidden_size=64, layers=1, heads=2, kv_heads=1)
    (seconds,) = benchmark("trainer_throughput").plain_loop(str(model), 1, 2, 64)
    assert seconds > 0


def test_env_workers_and_orchestrator_throughput_set_up(tmp_path, monkeypatch):
    """What each does before its inference server is up: the tasks env_workers ships, and the prompts and client
    orchestrator_throughput's two sides send."""
    from transformers import AutoTokenizer

    from rl.envs.config import EnvConfig
    from rl.envs.loading import load_environment
    from rl.tiny_model import build_tiny_model

    tasks = benchmark("env_workers").tasks_data(score_ms=1.0)
    assert len(tasks) == 256 and tasks[0]["score_ms"] == 1.0
    orch = benchmark("orchestrator_throughput")
    model = str(build_tiny_model(tmp_path / "tiny", hidden_size=64, layers=1, heads=2, kv_heads=1))
    env = load_environment(EnvConfig(id="reverse-text", args={"num_examples": 2}, workers=0))
    prompts = orch.rendered_prompts(env, AutoTokenizer.from_pretrained(model), 2)
    assert len(prompts) == 2 and all(prompts)
    monkeypatch.setattr(sys, "argv", ["orchestrator_throughput", "--model", model, "--max-tokens", "4"])
    assert orch.sampling(orch.parse_args()).extra == {"min_tokens": 4}


def test_launcher_command_lines_of_concurrency_and_its_last_line(model, tmp_path, monkeypatch, capsys):
    """Each side's command line is accepted; the last line compares the adaptive side with the best and the worst
    fixed cap, from the records past the warm-up."""
    monkeypatch.setattr(sys, "argv", sys.argv)
    concurrency = benchmark("concurrency")
    args = parsed(concurrency, ["--model", str(model)])
    for side, flags in concurrency.side_flags(args).items():
        dry_run(concurrency.rl_command(model, tmp_path / side, args, *concurrency.run_flags(args), *flags), capsys)

    def steps(tokens: int, preemptions: int, cap: int | None = None, turns: float = 0) -> list[dict]:
        return [{"step": i, "time": 10.0 * i, "completion_tokens": tokens, "samples": 5,
                 "engine/preemptions": preemptions, "num_turns": turns,
                 **({"concurrency/cap": cap} if cap else {})} for i in range(3)]

    results = {"low": [concurrency.measure(steps(100, 0, turns=1.9))],
               "high": [concurrency.measure(steps(200, 30, turns=1.8))],
               "high-fcfs": [concurrency.measure(steps(150, 20, turns=1.25))],
               "adaptive": [concurrency.measure(steps(300, 4, cap=24))]}
    assert results["adaptive"][0] == {"tokens_per_s": 600 / 20, "seconds": 20.0, "samples_per_s": 0.5, "turns": 0,
                                      "withheld": 0, "discarded": 0.0, "preemptions": 8, "cap": 24, "kv": None,
                                      "shed": 0}
    assert concurrency.summary(results) == ("adaptive 1.50x tokens/s of the best fixed cap, 3.00x of the worst, "
                                            "preemptions 8 vs 60; turns per trained rollout: high 1.80 (first come "
                                            "first served 1.25), low 1.90")
    assert "--scheduling-policy" in concurrency.side_flags(args)["high-fcfs"][-1]


def test_launcher_command_lines_of_router_replay_and_what_it_measures(model, tmp_path, monkeypatch, capsys):
    """Both sides' command lines are accepted; the measure is the steps' mean, and a run whose trainer saw no
    record of inference's routing (a dense model) is an error, not a figure."""
    monkeypatch.setattr(sys, "argv", sys.argv)
    replay = benchmark("router_replay")
    args = parsed(replay, ["--model", str(model)])
    for side, flags in replay.SIDES.items():
        dry_run(replay.rl_command(model, tmp_path / side, args, *flags), capsys)
    steps = [{"moe/routed_as_recorded": share, "moe/router_agreement": share, "mismatch_kl": kl}
             for share, kl in ((0.96, 2e-6), (0.98, 4e-6))]
    assert replay.measure(steps) == pytest.approx({"moe/routed_as_recorded": 0.97, "moe/router_agreement": 0.97,
                                                   "mismatch_kl": 3e-6})
    with pytest.raises(RuntimeError, match="is --model a mixture of experts"):
        replay.measure([{"mismatch_kl": 1e-6}])


def test_launcher_command_lines_of_mismatch_and_what_it_measures(model, tmp_path, monkeypatch, capsys):
    """Each (model, served dtype) run's command line is accepted; the measure is the steps' mean of the mismatch KL
    and of the logprob correlation (a step without one, its tokens all alike, left out)."""
    monkeypatch.setattr(sys, "argv", sys.argv)
    mismatch = benchmark("mismatch")
    args = parsed(mismatch, ["--qwen3", str(model), "--qwen3-5", str(model)])
    for dtype in mismatch.DTYPES:
        args.dtype = dtype
        dry_run(benchmark("router_replay").rl_command(model, tmp_path / dtype, args), capsys)
    steps = [{"mismatch_kl": 2e-6, "mismatch_corr": 0.99}, {"mismatch_kl": 4e-6}]
    assert mismatch.measure(steps) == pytest.approx({"mismatch_kl": 3e-6, "mismatch_corr": 0.99})


def test_launcher_command_lines_of_off_policy_and_what_it_measures(model, tmp_path, monkeypatch, capsys):
    """Each side's command line is accepted (the corrections as the loss config spells them); the measure is the
    run's reward gain as its summary computes it, the staleness of its batches, the sequences masked."""
    monkeypatch.setattr(sys, "argv", sys.argv)
    off_policy = benchmark("off_policy")
    args = parsed(off_policy, ["--model", str(model)])
    for side in off_policy.SIDES:
        dry_run(off_policy.rl_command(args, tmp_path / side, side), capsys)
    records = [{"process": "orchestrator", "step": i, "reward": 0.1 * (i >= 3), "staleness": i % 3}
               for i in range(6)] + [{"process": "trainer", "step": i, "masked_seq_frac": 0.25} for i in range(6)]
    result = off_policy.measure(records)
    assert result["gain"] == pytest.approx(0.1) and result["noise"] == 0.0
    assert (result["staleness_max"], result["masked_seq"]) == (2, 0.25)
    assert result["staleness_mean"] == pytest.approx(1.0)


def test_launcher_command_lines_of_reproducible_and_where_two_runs_first_differ(model, tmp_path, monkeypatch, capsys):
    """Each side's command line is accepted; two runs' first difference is the first step whose batch tokens or
    served checksums differ."""
    import torch
    from safetensors.torch import save_file

    monkeypatch.setattr(sys, "argv", sys.argv)
    reproducible = benchmark("reproducible")
    args = parsed(reproducible, ["--model", str(model)])
    for side in reproducible.SIDES:
        dry_run(reproducible.rl_command(args, tmp_path / side, side), capsys)
    for name, last in (("a", 3), ("b", 4)):
        run = tmp_path / name
        for step in range(3):
            (run / "rollouts" / f"step_{step}").mkdir(parents=True)
            save_file({"input_ids": torch.tensor([1, 2, step])}, str(run / "rollouts" / f"step_{step}" /
                                                                    "rank_0.safetensors"))
        (run / "metrics.jsonl").write_text("".join(json.dumps(
            {"process": "orchestrator", "step": s, "served_checksums": [f"c{s if s < 2 else last}"]}) + "\n"
            for s in range(3)))
    assert reproducible.first_difference(tmp_path / "a", tmp_path / "b", 3) == 2
    assert reproducible.first_difference(tmp_path / "a", tmp_path / "a", 3) is None


def test_the_tinker_api_benchmarks_start_serve_api_with_flags_it_accepts(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", sys.argv)
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    tinker_api = benchmark("tinker_api")
    flags = tinker_api.common_flags(parsed(tinker_api, ["--model", str(model)]), tmp_path / "api")
    dry_run([*LAUNCHER, "serve-api", *flags, "--api.served-model-name", "Qwen/Qwen3-8B"], capsys)
    cookbook = benchmark("tinker_cookbook")
    sys.argv = ["benchmark", "--recipe", "verifiers_rl", "--model", str(model), "--out", str(tmp_path / "cb"),
                "--dry-run", "--groups", "64", "--steps", "32"]
    cookbook.main()
    printed = capsys.readouterr().out
    assert "serve-api" in printed and "--api.served-model-name Qwen/Qwen3-8B" in printed
    assert "vf_env_id=reverse-text" in printed and "cookbook_fix" in printed
    assert "groups_per_batch=64 'vf_env_args={\"num_examples\": 2048}'" in printed  # a task for every group
