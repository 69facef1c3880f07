"""Images through rl (issue 86, part 5), piece by piece: the batch format's image fields, the orchestrator's pixel
inputs and their checks, the trainer's 3-D positions against transformers' own, the torchvision-free processor,
the proof's names for a vision-language model, and the count-shapes environment."""

import asyncio
import base64
import io
import subprocess
import sys

import pytest
import torch

from rl.samples import Sample, check_batch, decode_samples, encode_samples


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    from rl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vl") / "model", arch="qwen3_5_vl")


def image_sample(n_images: int = 1, tokens: int = 6) -> Sample:
    grid = torch.tensor([[1, 4, 4]] * n_images)
    return Sample(list(range(tokens)), [0] * (tokens - 1) + [1], [0.0] * tokens, 0.5, 1.0, 0,
                  pixel_values=torch.randn(16 * n_images, 8), image_grid_thw=grid)


def test_a_batch_carries_each_samples_images_and_gives_them_back():
    samples = [image_sample(2), Sample([1, 2, 3], [0, 1, 1], [0.0, -1, -1], 0.1, 0.0, 0), image_sample(1)]
    tensors = encode_samples(samples)
    assert tensors["image_counts"].tolist() == [2, 0, 1] and list(tensors["pixel_values"].shape) == [48, 8]
    decoded = decode_samples(tensors)
    assert torch.equal(decoded[0].pixel_values, samples[0].pixel_values)
    assert torch.equal(decoded[2].image_grid_thw, samples[2].image_grid_thw)
    assert decoded[1].pixel_values is None and decoded[1].image_grid_thw is None
    assert "pixel_values" not in encode_samples(samples[1:2])  # text only: no image fields


@pytest.mark.parametrize("spoil, error", [
    (lambda t: t.pop("image_counts"), "without the other image fields"),
    (lambda t: t.__setitem__("image_counts", torch.tensor([1, 0, 1])), "do not count the 3 images"),
    (lambda t: t.__setitem__("pixel_values", t["pixel_values"][:40]), "whose patches are the 40 rows"),
    (lambda t: t.__setitem__("image_grid_thw", t["image_grid_thw"].float()), "must be 2-dimensional int64"),
    (lambda t: t["pixel_values"].__setitem__((0, 0), float("nan")), "pixel_values holds NaN"),
    (lambda t: t["image_grid_thw"].__setitem__((0, 1), 0), "positive sizes"),
])
def test_a_batch_whose_image_fields_disagree_is_refused_by_name(spoil, error):
    tensors = encode_samples([image_sample(2), Sample([1, 2], [0, 1], [0.0, -1], 0.1, 0.0, 0), image_sample(1)])
    spoil(tensors)
    with pytest.raises(ValueError, match=error):
        check_batch(tensors)


def test_a_sample_whose_pixels_do_not_fill_its_grid_is_refused():
    with pytest.raises(ValueError, match="one row per patch"):
        Sample([1, 2], [0, 1], [0.0, 0.0], 0.0, 0.0, 0, pixel_values=torch.zeros(15, 8),
               image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="come together"):
        Sample([1, 2], [0, 1], [0.0, 0.0], 0.0, 0.0, 0, pixel_values=torch.zeros(16, 8))


def png_url(size: int = 64, colour: str = "red") -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_orchestrator_makes_pixel_inputs_and_checks_them_against_the_servers_tokens(vl_model):
    from rl.orchestrator.vision import ImageInputs, ImageTokenSampled

    images = ImageInputs(str(vl_model))
    pad = images.image_token_id
    ids = [1, pad, pad, pad, pad, 2, 3]  # 64x64 pixels: 4x4 patches, merged 2x2: 4 tokens
    made = images([png_url()], ids, [0] * 6 + [1])
    assert made["image_grid_thw"].tolist() == [[1, 4, 4]] and list(made["pixel_values"].shape) == [16, 1536]
    with pytest.raises(ValueError, match="make 4 image tokens here, but the server expanded them into 3"):
        images([png_url()], ids[:4] + ids[5:], [0] * 6)
    with pytest.raises(ImageTokenSampled):
        images([png_url()], ids + [pad], [0] * 7 + [1])
    with pytest.raises(ValueError, match="must be a base64 data URL"):
        images(["https://example.com/cat.png"], ids, [0] * 7)
    with pytest.raises(ValueError, match="does not decode to an image"):
        images(["data:image/png;base64,bm90IGFuIGltYWdl"], ids, [0] * 7)


def test_image_tokens_get_the_positions_transformers_gives_each_sample_alone(vl_model):
    """A packed row of an image sample, a text sample and another image sample: each sample's 3-D positions as
    transformers' `get_rope_index` computes for it alone, the first row the plain restarting positions."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from rl.trainer.vision import vision_forward_inputs

    config = AutoConfig.from_pretrained(vl_model)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    pad, start = config.image_token_id, config.vision_start_token_id
    first = torch.tensor([5, start, *[pad] * 4, 7, 8])  # a 4x4 grid: 4 tokens
    second = torch.tensor([9, 10, 11])
    third = torch.tensor([start, *[pad] * 6, 12])  # a 4x6 grid: 6 tokens
    grids = torch.tensor([[1, 4, 4], [1, 4, 6]])
    row = torch.cat([first, second, third])[None]
    positions = torch.cat([torch.arange(len(s)) for s in (first, second, third)])[None]
    inputs = vision_forward_inputs(model, row, positions, (8, 3, 8), torch.zeros(40, 1536), grids)
    got = inputs["position_ids"]
    assert torch.equal(got[0], positions)
    for ids, grid, (lo, hi) in ((first, grids[:1], (0, 8)), (third, grids[1:], (11, 19))):
        want, _ = model.model.get_rope_index(ids[None], (ids == pad).int()[None], image_grid_thw=grid)
        assert torch.equal(got[1:, :, lo:hi], want)
    assert torch.equal(got[1:, 0, 8:11], torch.arange(3).expand(3, 3))
    assert not torch.equal(got[1, 0, :8], got[2, 0, :8])  # height and width differ inside the image
    with pytest.raises(ValueError, match="more image tokens than"):
        vision_forward_inputs(model, row, positions, (8, 3, 8), torch.zeros(16, 1536), grids[:1])


def test_the_vision_tower_is_frozen_unless_asked_and_trained_on_one_rank_only(vl_model):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rl.trainer.vision import prepare_vision

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(vl_model))
    prepare_vision(model, trainable=False)
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    assert all(p.requires_grad for p in model.model.language_model.parameters())
    assert model.config.vision_config._attn_implementation == "sdpa"
    prepare_vision(model, trainable=True)
    assert all(p.requires_grad for p in model.model.visual.parameters())
    from rl.tiny_model import build_config, build_tokenizer

    with torch.device("meta"):
        text = AutoModelForCausalLM.from_config(build_config(build_tokenizer(), 128, 2, 4, 2))
    with pytest.raises(ValueError, match="has no vision tower"):
        prepare_vision(text, trainable=True)


def test_a_micro_batch_holds_its_samples_images_in_order_and_an_image_sample_is_never_cut():
    from rl.trainer.data import build_micro_batches, truncate

    samples = [image_sample(1, tokens=4), Sample([1, 2], [0, 1], [0.0, -1], 0.1, 0.0, 0), image_sample(2, tokens=9)]
    packed = build_micro_batches(samples, [1.0] * 3, 64, 8, packing=True, pad_id=0)
    (row,) = packed
    order = [samples[i] for i in (2, 0, 1)]  # longest first
    assert row.sample_lengths == tuple(len(s.input_ids) for s in order)
    assert torch.equal(row.pixel_values, torch.cat([order[0].pixel_values, order[1].pixel_values]))
    padded = build_micro_batches(samples, [1.0] * 3, 64, 2, packing=False, pad_id=0)
    assert len(padded[0].image_grid_thw) == 1 and padded[1].image_grid_thw.tolist() == [[1, 4, 4]] * 2
    with pytest.raises(ValueError, match="over seq_len 5"):
        truncate(samples[2], 5)


def test_a_processor_with_videos_loads_without_torchvision_and_refuses_a_video_by_name(vl_model):
    script = (
        "from rl.patches import qwen2_vl_without_torchvision as p; p()\n"
        "from transformers import AutoProcessor\n"
        f"processor = AutoProcessor.from_pretrained({str(vl_model)!r})\n"
        "print(type(processor.image_processor).__name__, processor.video_processor.merge_size)\n"
        "try:\n    processor.video_processor([])\nexcept RuntimeError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Qwen2VLImageProcessorPil 2" in done.stdout and "videos need torchvision" in done.stdout


def test_the_proof_names_a_vision_language_models_tensors_as_its_checkpoint_does():
    from vllm.model_executor.models.utils import WeightsMapper

    from rl.inference.fingerprint import _joined_parts, checkpoint_name
    from rl.inference.sharding import Part

    class Served(torch.nn.Module):
        supports_multimodal = True
        hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={
            "model.visual.": "visual.", "lm_head.": "language_model.lm_head.",
            "model.language_model.": "language_model.model."})

    model = Served()
    assert checkpoint_name(model, "language_model.model.layers.0.mlp.up_proj.weight") == \
        "model.language_model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name(model, "visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    assert checkpoint_name(model, "language_model.lm_head.weight") == "lm_head.weight"
    assert checkpoint_name(torch.nn.Linear(2, 2), "model.norm.weight") == "model.norm.weight"

    class TextOnly(torch.nn.Module):  # Qwen3.5's causal LM also reads a VLM's names: its own stay as they are
        hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model."})

    assert checkpoint_name(TextOnly(), "model.layers.0.linear_attn.A_log") == "model.layers.0.linear_attn.A_log"
    # a vision tower's qkv: three parts of the layer, one tensor of the checkpoint
    (joined,) = _joined_parts([Part(64, 64, None)] * 3, ["model.visual.blocks.0.attn.qkv"])
    assert (joined.local, joined.full) == (192, 192)


def test_the_tied_head_stands_for_either_layouts_embedding():
    from rl.safetensors_io import tied_head_source

    assert tied_head_source(["model.embed_tokens.weight"]) == "model.embed_tokens.weight"
    assert tied_head_source(["model.language_model.embed_tokens.weight", "model.visual.x"]) == \
        "model.language_model.embed_tokens.weight"
    assert tied_head_source(["lm_head.weight", "model.embed_tokens.weight"]) is None


def test_count_shapes_draws_the_same_pictures_and_scores_the_count():
    from count_shapes.taskset import CountShapesConfig, draw_picture, first_number

    config = CountShapesConfig(max_shapes=4, seed=3)
    assert draw_picture(config, 7) == draw_picture(config, 7)
    counts = {draw_picture(config, i)[0] for i in range(40)}
    assert counts == {1, 2, 3, 4}
    assert first_number("I see 3 shapes, not 4") == 3 and first_number("none") is None

    from count_shapes import CountShapesTask
    from count_shapes.taskset import CountShapesData

    task = CountShapesTask(CountShapesData(id="t", prompt="x", count=3), None)
    trace = type("Trace", (), {"last_reply": "3"})()
    assert asyncio.run(task.count_reward(task.data, trace)) == 1.0
    trace.last_reply = "5"
    assert asyncio.run(task.count_reward(task.data, trace)) == pytest.approx(1 / 3)
