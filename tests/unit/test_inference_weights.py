"""Weight fingerprints (no vLLM): exact sampled columns, the comparison a worker makes of served against file
fingerprints, and reading a published step's files once."""

import pytest
import torch

from rl.inference.worker import compare, probe_inputs, tensor_fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_part_is_the_sampled_columns_bit_for_bit(dtype):
    w = torch.randn(300, 77)
    cols, _ = probe_inputs(77, dtype)
    assert torch.equal(tensor_fingerprint(w, dtype).exact, w[:, cols].to(dtype).T)


def prints_of(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: tensor_fingerprint(t, torch.float32) for name, t in tensors.items()}


def test_served_weights_are_compared_with_the_files():
    tensors = {"a.weight": torch.randn(16, 8), "a.bias": torch.randn(16)}
    files = prints_of(tensors)
    report = compare(prints_of(tensors), files, torch.float32)
    assert report["ok"] and report["max_exact_diff"] == 0

    stale = dict(tensors, **{"a.weight": tensors["a.weight"] + 1e-3})  # an update that did not arrive
    report = compare(prints_of(stale), files, torch.float32)
    assert not report["ok"] and "a.weight" in report["differing"][0]

    poisoned = dict(tensors, **{"a.bias": tensors["a.bias"].clone().index_fill_(0, torch.tensor([3]), float("nan"))})
    report = compare(prints_of(poisoned), files, torch.float32)
    assert not report["ok"] and "a.bias" in report["differing"][0]

    report = compare(prints_of({"a.weight": tensors["a.weight"]}), files, torch.float32)
    assert not report["ok"] and report["mismatched"] == ["not served: a.bias"]


def test_the_checksum_tells_apart_weights_that_differ_outside_the_sampled_columns(tmp_path):
    """The fingerprint samples a few columns exactly; the checksum must cover every element."""
    from safetensors.torch import save_file

    from rl.inference.worker import checkpoint_fingerprint

    w = torch.randn(16, 64)
    cols, _ = probe_inputs(64, torch.float32)
    unsampled = next(j for j in range(64) if j not in cols)
    changed = w.clone()
    changed[3, unsampled] += 0.5
    for name, weight in (("a", w), ("b", changed)):
        (tmp_path / name).mkdir()
        save_file({"layer.weight": weight}, str(tmp_path / name / "model.safetensors"))
    (prints_a, checksum_a), (prints_b, checksum_b) = (
        checkpoint_fingerprint(tmp_path / name, torch.float32, tied=False) for name in ("a", "b")
    )
    assert torch.equal(prints_a["layer.weight"].exact, prints_b["layer.weight"].exact)  # the sample cannot tell
    assert checksum_a != checksum_b
    assert checkpoint_fingerprint(tmp_path / "a", torch.float32, tied=False)[1] == checksum_a  # deterministic


def published_step(tmp_path, shards: list[dict[str, torch.Tensor]]):
    from safetensors.torch import save_file

    from rl.manifest import mark_stable

    directory = tmp_path / "step_1"
    directory.mkdir()
    for i, shard in enumerate(shards):
        save_file(shard, str(directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"))
    (directory / "config.json").write_text("{}")
    mark_stable(directory, step=1)
    return directory


def test_a_step_is_read_once_and_gives_the_files_tensors(tmp_path):
    from safetensors.torch import load_file

    from rl.inference.reading import ReadCount, read_step
    from rl.manifest import read_manifest

    shards = [{"a.weight": torch.randn(8, 4), "a.bias": torch.randn(8)},
              {"b.weight": torch.randn(3, 5).bfloat16(), "c.steps": torch.arange(7)}]
    directory = published_step(tmp_path, shards)
    count = ReadCount()
    step = read_step(directory, read_manifest(directory), count)
    assert step.shapes() == {"a.weight": (8, 4), "a.bias": (8,), "b.weight": (3, 5), "c.steps": (7,)}
    tensors = dict(step.tensors())
    expected = {**load_file(str(directory / "model-00001-of-00002.safetensors")),
                **load_file(str(directory / "model-00002-of-00002.safetensors"))}
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[n], expected[n]) and tensors[n].dtype == expected[n].dtype for n in expected)
    weight_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    assert count.data_bytes == weight_bytes  # each weight file read exactly once, headers included
    assert count.files == sorted(p.name for p in directory.glob("*.safetensors"))


def test_a_weight_file_changed_after_publication_is_refused_before_any_tensor_is_given(tmp_path):
    from rl.inference.reading import ReadCount, read_step
    from rl.manifest import CorruptFileError, read_manifest

    directory = published_step(tmp_path, [{"a.weight": torch.randn(8, 4)}, {"b.weight": torch.randn(4, 4)}])
    manifest = read_manifest(directory)
    second = directory / "model-00002-of-00002.safetensors"
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF
    second.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="model-00002-of-00002.safetensors fails its CRC-32 check"):
        read_step(directory, manifest, ReadCount())  # vLLM's reload cannot stop halfway: nothing is given out


@pytest.mark.parametrize("header", [b"\xff" * 8, b"\x04\x00\x00\x00\x00\x00\x00\x00[1]]",
                                    b'\x30\x00\x00\x00\x00\x00\x00\x00{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}'])
def test_a_malformed_safetensors_header_is_a_corrupt_file(header):
    from rl.inference.reading import tensors_of
    from rl.manifest import CorruptFileError

    with pytest.raises(CorruptFileError):
        list(tensors_of(bytearray(header + bytes(16)), "f.safetensors"))
