"""Checks `rl` and `eval` run before they start anything: what would otherwise fail minutes later, inside a
child process, after vLLM has loaded (a model path that is not there, an environment that is not
installed or whose arguments do not validate)."""

from __future__ import annotations

import filecmp
from pathlib import Path

from rl.config import ConfigError
from rl.orchestrator.config import OrchestratorConfig
from rl.protocol import RunPaths
from rl.trainer.config import TrainerConfig


TINY_MODEL_HINT = "the tiny local model is built with `uv run tiny-model --out models/tiny`"
# What a Hugging Face tokenizer loads from (fast and slow ones), besides the files' own sizes and names.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def check_model(name: str) -> None:
    """A local model must be a Hugging Face directory; a name that is not on disk must be a hub id that is in the
    local cache or on the hub (otherwise vLLM fails minutes later with a hub traceback in its log).

    `org/model` is a hub id unless `org` is a local directory, in which case a local path was meant."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ConfigError(f"model {name!r} is not a Hugging Face model directory (no config.json in it)")
        return
    parts = name.split("/")
    looks_local = (
        path.is_absolute() or name.startswith((".", "~")) or len(parts) != 2 or Path(parts[0]).is_dir()
    )
    if looks_local or not all(parts):
        raise ConfigError(f"model {name!r} does not exist (neither a local directory nor a hub id org/name); "
                          f"{TINY_MODEL_HINT}")
    missing = hub_model_missing(name)
    if missing:
        raise ConfigError(f"model {name!r} is neither a local directory (no {path.absolute()}) nor a model on the "
                          f"Hugging Face hub: {missing}; {TINY_MODEL_HINT}")


def hub_model_missing(name: str) -> str | None:
    """Why hub id `name` cannot be loaded (not cached, and not found or the hub unreachable), else None."""
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.utils import RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    try:
        model_info(name, timeout=10)
    except RepositoryNotFoundError:
        return "the hub has no such model (or it is gated: set HF_TOKEN)"
    except Exception as e:  # noqa: BLE001 - offline, DNS, proxy, timeout: all mean it cannot be downloaded
        return f"it is not in the local cache and the hub is unreachable ({type(e).__name__}: {e})"
    return None


def same_tokenizer_files(a: str, b: str) -> bool:
    """Two local models whose tokenizer files are the same bytes tokenize alike: nothing needs loading to know."""
    first, second = Path(a), Path(b)
    if not (first.is_dir() and second.is_dir() and (first / "tokenizer.json").is_file()):
        return False
    names = [name for name in TOKENIZER_FILES if (first / name).exists() or (second / name).exists()]
    return all((first / name).is_file() and (second / name).is_file()
               and filecmp.cmp(first / name, second / name, shallow=False) for name in names)


def check_same_tokenizer(student: str, teacher: str) -> None:
    """On-policy distillation compares the two models token by token: the teacher must tokenize the probe texts
    (rl/orchestrator/teacher.py, which checks a teacher served elsewhere the same way) as the student does."""
    check_model(teacher)
    if same_tokenizer_files(student, teacher):
        return
    from transformers import AutoTokenizer

    from rl.orchestrator.teacher import PROBES, tokenizer_mismatch

    ours, theirs = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    for probe in PROBES:
        a, b = ours(probe)["input_ids"], theirs(probe)["input_ids"]
        if a != b:
            raise ConfigError(tokenizer_mismatch(teacher, student, probe, b, a))


def check_lora_targets(config: TrainerConfig) -> None:
    """Every trainer.lora target names a linear layer of the model (on the meta device: nothing is loaded)."""
    if config.lora is None:
        return
    from rl.trainer.lora import check_targets
    from rl.trainer.model import meta_model

    check_targets(meta_model(config.model.name, config.attn_implementation, config.logprob_chunk_tokens),
                  config.lora.target_modules)


def check_environments(config: OrchestratorConfig) -> None:
    """Load every training and eval environment once, as the orchestrator will, and pick the model's
    renderer for them (one that can do tools where an environment serves tools)."""
    from rl.envs.loading import EnvLoadError, load_environments
    from rl.renderer import chat_renderer

    loaded = []
    for where, envs in (("orchestrator.env", config.env), ("orchestrator.eval.env", config.eval.env)):
        try:
            loaded += load_environments(envs, where)
        except EnvLoadError as e:
            raise ConfigError(str(e)) from None
    if config.model.renderer != "auto" or any(env.toolsets for env in loaded):  # else nothing can be wrong yet
        chat_renderer(config.model.renderer, config.model.name, loaded)


def check_output_dir(paths: RunPaths, resuming: bool) -> None:
    """A new run needs a directory of its own; nothing in an existing run is touched."""
    if paths.root.exists() and not paths.root.is_dir():
        raise ConfigError(f"output directory {paths.root} exists and is not a directory")
    if resuming:
        return
    taken = [p for p in (paths.metrics, paths.rollouts_root, paths.weights_root, paths.checkpoints_root) if p.exists()]
    if taken:
        raise ConfigError(
            f"output directory {paths.root} already holds a run ({taken[0].name} exists); "
            "choose another --output-dir, delete that one, or continue it with --resume"
        )
