"""Qwen3.5 with its vision tower (`tiny-model --arch qwen3_5_vl`) on the offline count-shapes environment, whose
prompts carry a picture (issue 86): rollouts' images reach the trainer as pixel inputs, two trainer ranks train the
language model with the vision tower frozen, and every step is published, reloaded in place and proved. Served in
float32 and trained in float32, the trainer computes what the server sampled from: the images' features and their
3-D rotary positions included (mismatch_kl <= 1e-6; without the images it is far above)."""

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from rl.protocol import RunPaths, read_metrics
from tests.integration.launched import Launched, rl_command

pytestmark = pytest.mark.integration

COUNT_SHAPES = json.dumps([{"id": "count-shapes", "args": {"num_examples": 200, "max_shapes": 4}}])


def test_images_train_three_steps_with_the_vision_tower_frozen_each_step_proved(tmp_path):
    model = tmp_path / "qwen3_5_vl"
    subprocess.run([sys.executable, "-m", "rl.tiny_model", "--out", str(model), "--arch", "qwen3_5_vl"], check=True,
                   capture_output=True)
    out = tmp_path / "run"
    run = Launched(rl_command(model, out, 3, "--async-level", "0", "--orchestrator.env", COUNT_SHAPES,
                              "--orchestrator.sampling.max-tokens", "4", "--ckpt.interval", "100"))
    assert run.wait(timeout=300) == 0, "".join(run.lines[-60:])
    records = read_metrics(RunPaths(out))
    trainer = [m for m in records if m["process"] == "trainer"]
    assert [m["step"] for m in trainer] == [0, 1, 2]
    assert all(m["mismatch_kl"] <= 1e-6 for m in trainer), [m["mismatch_kl"] for m in trainer]
    served = {m["step"]: m.get("served_checksums") for m in records if m["process"] == "orchestrator"}
    assert served[1] and served[2] and served[1] != served[2], served

    batch = load_file(str(RunPaths(out).rollout_file(2, 0)))
    assert batch["image_counts"].min() == 1 and len(batch["image_grid_thw"]) == len(batch["lengths"])
    base = load_file(str(model / "model.safetensors"))
    assert (out / "weights" / "step_3" / "preprocessor_config.json").is_file()  # loads as the base model does
    published = load_file(str(next((out / "weights" / "step_3").glob("*.safetensors"))))
    vision = [name for name in base if name.startswith("model.visual.")]
    assert vision and all((published[name] == base[name]).all() for name in vision)  # frozen
    language = [name for name in base if name.startswith("model.language_model.layers.")]
    assert any(not (published[name] == base[name]).all() for name in language)  # trained
