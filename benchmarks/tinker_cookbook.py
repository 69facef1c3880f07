"""tinker-cookbook's recipes against `rl serve-api` on the tiny model.

- `--recipe sl_basic` (0.6.1, unmodified): does the loss fall? Run as its README says (`python -m
  tinker_cookbook.recipes.sl_basic key=value ...`), with only its own settings: the service's URL, a model name from
  its registry, its `FromConversationFileBuilder` over the conversations file it ships (no hub dataset here).
- `--recipe verifiers_rl` (0.6.1): does the reward rise by 3 standard errors? Serve the quickstart's SFT model
  (`--model`). Two changes the recipe needs whatever serves it: verifiers 0.1.9 (its pin; rl's environments speak
  0.4), installed apart with `benchmarks/cookbook_envs/reverse_text.py`, rl's reverse-text for that API; and
  `cookbook_envs/cookbook_fix.py`, without which the recipe fails with a TypeError in 0.5.5 to 0.6.1.

Two things make the runs possible offline, neither touching a recipe:

- rl serves the tiny model under a hub name (`--api.served-model-name Qwen/Qwen3-8B`), and a Hugging Face cache made
  here holds the tiny model's tokenizer under that name (`HF_HUB_OFFLINE=1`), where the recipe loads it;
- the cookbook is installed beside rl's environment (`--packages`, `uv pip install --target`, without dependencies:
  tinker-cookbook 0.6.1 requires tml-renderers >= 0.4.1, which PyPI does not hold; 0.2.1 is installed).

The last line reads:

tinker cookbook sl_basic: loss <first> -> <last> over <n> steps (<falls|does not fall>)
tinker cookbook verifiers_rl: reward <first fifth> -> <last fifth>, gain <g> against noise <n> (<rises|does not>)

    uv run --no-sync python benchmarks/tinker_cookbook.py --model /tmp/tiny [--steps 12] [--dry-run]
    uv run --no-sync python benchmarks/tinker_cookbook.py --recipe verifiers_rl --model <SFT model> --steps 32 --lr 2e-3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tinker_api import KEY, ROOT, common_flags, wait_up

SERVED_NAME = "Qwen/Qwen3-8B"  # in the cookbook's model registry, whose renderer (qwen3) the tiny model's tokens have
PACKAGES = ["tinker-cookbook==0.6.1", "chz", "blobfile", "tml-renderers", "termcolor", "tiktoken", "pyrage",
            "cloudpickle", "datasets==4.0.0", "pyarrow==24.0.0", "dill==0.3.9", "multiprocess==0.70.17", "fsspec",
            "pandas", "python-dateutil", "pytz", "tzdata", "lxml", "pycryptodomex"]
# datasets 5.2 (with pyarrow 24 or 26, dill 0.4.1 or 0.3.9) fails to fingerprint a list of chats here ("Can't pickle
# <class 'MonthDayNano'>"); 4.0.0 does not


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--recipe", choices=["sl_basic", "verifiers_rl"], default="sl_basic")
    parser.add_argument("--verifiers", type=Path, default=Path(tempfile.gettempdir()) / "verifiers-0.1.9-packages")
    parser.add_argument("--steps", type=int, default=12, help="the recipe's max_steps")
    parser.add_argument("--batch", type=int, default=8, help="the recipe's batch size")
    parser.add_argument("--lr", type=float, default=5e-3, help="the recipe's learning_rate")
    parser.add_argument("--groups", type=int, help="verifiers_rl's groups_per_batch (default: the recipe's, 32 groups "
                                                   "of 8)")
    parser.add_argument("--packages", type=Path, default=Path(tempfile.gettempdir()) / "tinker-cookbook-packages")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    return parser.parse_args()


def install(target: Path, packages: list[str], module: str) -> None:
    if (target / module).is_dir():
        return
    subprocess.run(["uv", "pip", "install", "--python", sys.executable, "--target", str(target), "--no-deps",
                    *packages], check=True)


def hub_cache(model: Path, root: Path) -> Path:
    """A Hugging Face hub cache holding `model`'s tokenizer and config as SERVED_NAME's one revision."""
    revision = "0" * 40
    repo = root / f"models--{SERVED_NAME.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (model / name).is_file():
            shutil.copy(model / name, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return root


VERIFIERS = ["verifiers==0.1.9", "openai-agents", "nest-asyncio", "math-verify", "latex2sympy2_extended", "wget", "mcp",
             "textual", "griffe", "griffelib", "colorama"]
ENVS = Path(__file__).resolve().parent / "cookbook_envs"


def verifiers_rl_command(args, log_path: Path) -> list[str]:
    run = ("import cookbook_fix, runpy; runpy.run_module('tinker_cookbook.recipes.verifiers_rl.train', "
           "run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", run, f"model_name={SERVED_NAME}", "renderer_name=qwen3", "vf_env_id=reverse-text",
            f"learning_rate={args.lr}", "max_tokens=16", f"max_steps={args.steps}", f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete", *([] if args.groups is None else [  # tasks enough for every step
                f"groups_per_batch={args.groups}", f'vf_env_args={{"num_examples": {args.groups * args.steps}}}'])]


def recipe_command(args, url: str, conversations: Path, log_path: Path) -> list[str]:
    builder = "tinker_cookbook.supervised.data:FromConversationFileBuilder"
    return [sys.executable, "-m", "tinker_cookbook.recipes.sl_basic", f"model_name={SERVED_NAME}",
            f"base_url={url}", f"log_path={log_path}", f"max_steps={args.steps}", f"learning_rate={args.lr}",
            "eval_every=0", f"dataset_builder={builder}", f"dataset_builder.file_path={conversations}",
            f"dataset_builder.common_config.model_name_for_tokenizer={SERVED_NAME}",
            "dataset_builder.common_config.renderer_name=qwen3", "dataset_builder.common_config.max_length=120",
            f"dataset_builder.common_config.batch_size={args.batch}"]


def logged(log_path: Path, key: str) -> list[float]:
    records = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r[key] for r in records if key in r]


def main() -> None:
    args = parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="tinker-cookbook-"))
    port = 19000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "rl.launcher.main", "serve-api", *common_flags(args_like(args), out / "run"),
             "--api.port", str(port), "--inference.port", str(port + 1), "--api.served-model-name", SERVED_NAME]
    conversations = args.packages / "tinker_cookbook" / "example_data" / "conversations.jsonl"
    recipe = recipe_command(args, url, conversations, out / "recipe") if args.recipe == "sl_basic" \
        else verifiers_rl_command(args, out / "recipe")
    if args.dry_run:
        print("serve:", shlex.join(serve))
        print("recipe:", shlex.join(recipe))
        return
    install(args.packages, PACKAGES, "tinker_cookbook")
    path = [args.packages]
    if args.recipe == "verifiers_rl":
        install(args.verifiers, VERIFIERS, "verifiers")
        path = [ENVS, args.verifiers, args.packages]  # verifiers 0.1.9 and its reverse-text first
    env = os.environ | {"TINKER_API_KEY": KEY, "TINKER_BASE_URL": url, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
                        "HF_HUB_CACHE": str(hub_cache(args.model, out / "hf")),
                        "PYTHONPATH": os.pathsep.join(map(str, path))}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "serve.log", "w") as log:
        served = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        wait_up(url, served)
        with open(out / "recipe.log", "w") as log:
            subprocess.run(recipe, stdout=log, stderr=subprocess.STDOUT, cwd=out, env=env, check=True, timeout=1800,
                           input="", text=True)
    finally:
        served.terminate()
        served.wait(60)
    if args.recipe == "sl_basic":
        seen = logged(out / "recipe", "train_mean_nll")
        verdict = "falls" if len(seen) > 1 and seen[-1] < seen[0] else "does not fall"
        print(f"recipe losses (train_mean_nll): {[round(v, 3) for v in seen]} ({out})")
        print(f"tinker cookbook sl_basic: loss {seen[0]:.3f} -> {seen[-1]:.3f} over {len(seen)} steps ({verdict})")
        return
    from rl.launcher.report import reward_change

    rewards = logged(out / "recipe", "env/all/reward/total")
    change = reward_change(rewards)
    verdict = "rises" if change["reward_gain"] > change["noise_3se"] else "does not"
    print(f"recipe rewards: {[round(v, 3) for v in rewards]} ({out})")
    print(f"tinker cookbook verifiers_rl: reward {change['start_reward']:.3f} -> {change['final_reward']:.3f}, gain "
          f"{change['reward_gain']:+.3f} against noise {change['noise_3se']:.3f} ({verdict})")


def args_like(args):
    """The few settings tinker_api.common_flags reads."""
    return argparse.Namespace(model=args.model, tokens=96)


if __name__ == "__main__":
    main()
