"""tinker-cookbook's `sl_basic` recipe, unmodified, against `rl serve-api` on the tiny model: does the loss fall?

The recipe is run as its README says (`python -m tinker_cookbook.recipes.sl_basic key=value ...`), with only its own
settings given on the command line: the service's URL, a model name from its registry, and its
`FromConversationFileBuilder` over the conversations file it ships (no hub dataset here). Two things make that
possible offline, neither touching the recipe:

- rl serves the tiny model under a hub name (`--api.served-model-name Qwen/Qwen3-8B`), and a Hugging Face cache made
  here holds the tiny model's tokenizer under that name (`HF_HUB_OFFLINE=1`), where the recipe loads it;
- the cookbook is installed beside rl's environment (`--packages`, `uv pip install --target`, without dependencies:
  tinker-cookbook 0.6.1 requires tml-renderers >= 0.4.1, which PyPI does not hold; 0.2.1 is installed).

The last line reads:

tinker cookbook sl_basic: loss <first> -> <last> over <n> steps (<falls|does not fall>)

    uv run --no-sync python benchmarks/tinker_cookbook.py --model /tmp/tiny [--steps 12] [--dry-run]
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
    parser.add_argument("--steps", type=int, default=12, help="the recipe's max_steps")
    parser.add_argument("--batch", type=int, default=8, help="the recipe's batch size")
    parser.add_argument("--lr", type=float, default=5e-3, help="the recipe's learning_rate")
    parser.add_argument("--packages", type=Path, default=Path(tempfile.gettempdir()) / "tinker-cookbook-packages")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    return parser.parse_args()


def install(packages: Path) -> None:
    if (packages / "tinker_cookbook").is_dir():
        return
    subprocess.run(["uv", "pip", "install", "--python", sys.executable, "--target", str(packages), "--no-deps",
                    *PACKAGES], check=True)


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


def recipe_command(args, url: str, conversations: Path, log_path: Path) -> list[str]:
    builder = "tinker_cookbook.supervised.data:FromConversationFileBuilder"
    return [sys.executable, "-m", "tinker_cookbook.recipes.sl_basic", f"model_name={SERVED_NAME}",
            f"base_url={url}", f"log_path={log_path}", f"max_steps={args.steps}", f"learning_rate={args.lr}",
            "eval_every=0", f"dataset_builder={builder}", f"dataset_builder.file_path={conversations}",
            f"dataset_builder.common_config.model_name_for_tokenizer={SERVED_NAME}",
            "dataset_builder.common_config.renderer_name=qwen3", "dataset_builder.common_config.max_length=120",
            f"dataset_builder.common_config.batch_size={args.batch}"]


def losses(log_path: Path) -> list[float]:
    records = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train_mean_nll"] for r in records if "train_mean_nll" in r]


def main() -> None:
    args = parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="tinker-cookbook-"))
    port = 19000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "rl.launcher.main", "serve-api", *common_flags(args_like(args), out / "run"),
             "--api.port", str(port), "--inference.port", str(port + 1), "--api.served-model-name", SERVED_NAME]
    conversations = args.packages / "tinker_cookbook" / "example_data" / "conversations.jsonl"
    recipe = recipe_command(args, url, conversations, out / "recipe")
    if args.dry_run:
        print("serve:", shlex.join(serve))
        print("recipe:", shlex.join(recipe))
        return
    install(args.packages)
    env = os.environ | {"TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
                        "HF_HUB_CACHE": str(hub_cache(args.model, out / "hf")), "PYTHONPATH": str(args.packages)}
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
    seen = losses(out / "recipe")
    verdict = "falls" if len(seen) > 1 and seen[-1] < seen[0] else "does not fall"
    print(f"recipe losses (train_mean_nll): {[round(v, 3) for v in seen]} ({out})")
    print(f"tinker cookbook sl_basic: loss {seen[0]:.3f} -> {seen[-1]:.3f} over {len(seen)} steps ({verdict})")


def args_like(args):
    """The few settings tinker_api.common_flags reads."""
    return argparse.Namespace(model=args.model, tokens=96)


if __name__ == "__main__":
    main()
