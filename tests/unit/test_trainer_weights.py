"""Background weight publication: the written weights are those of the step (not of later in-place
updates), the directory appears only complete, and a failed write is raised."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from rl.protocol import RunPaths, verify_stable
from rl.trainer.weights import WeightPublisher


def background_publisher(model_dir, paths: RunPaths) -> WeightPublisher:
    config, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    return WeightPublisher(paths, config, tokenizer, background=True)


def test_background_write_keeps_the_step_weights_and_appears_complete(tiny_model, tmp_path):
    paths = RunPaths(tmp_path)
    publisher = background_publisher(tiny_model, paths)
    weight = torch.ones(64, 64)
    publisher.publish(1, {"model.embed_tokens.weight": weight})
    weight.mul_(3)  # the optimizer's next in-place update, while the write may still be running
    publisher.publish(2, {"model.embed_tokens.weight": weight})  # waits for step 1 first
    publisher.close()
    for step, value in ((1, 1.0), (2, 3.0)):
        verify_stable(paths.weights(step))
        written = load_file(str(paths.weights(step) / "model.safetensors"))
        assert torch.equal(written["model.embed_tokens.weight"], torch.full((64, 64), value))
        assert torch.equal(written["lm_head.weight"], torch.full((64, 64), value))  # tied head written too


def test_a_failed_background_write_is_raised(tiny_model, tmp_path):
    (tmp_path / "weights").write_text("a file where the weights directory belongs")
    publisher = background_publisher(tiny_model, RunPaths(tmp_path))
    publisher.publish(1, {"model.embed_tokens.weight": torch.ones(2, 2)})
    with pytest.raises(OSError):
        publisher.close()


def test_a_published_step_is_a_hugging_face_directory_like_the_model(tiny_model, tmp_path):
    """Config and tokenizer files are serialized once per run and written into every step."""
    from transformers import AutoConfig, AutoTokenizer

    paths = RunPaths(tmp_path)
    publisher = WeightPublisher(paths, AutoConfig.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model),
                                background=False)
    for step in (1, 2):
        publisher.publish(step, {"model.embed_tokens.weight": torch.ones(2, 2)})
        verify_stable(paths.weights(step))
        config = lambda path: AutoConfig.from_pretrained(path).to_dict() | {"_name_or_path": None}  # noqa: E731
        assert config(paths.weights(step)) == config(tiny_model)
        text = "reverse this text"
        assert AutoTokenizer.from_pretrained(paths.weights(step))(text) == AutoTokenizer.from_pretrained(tiny_model)(text)
