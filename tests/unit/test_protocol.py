import threading
import time
import zlib

import pytest

from rl.samples import Sample
from rl.protocol import (
    STABLE,
    CorruptFileError,
    RunPaths,
    file_crc32,
    mark_stable,
    read_batch,
    stable_steps,
    verify_stable,
    wait_for_stable,
    write_batch,
)


def sample(n: int, version: int = 0) -> Sample:
    return Sample(list(range(n)), [0] * (n - 2) + [1, 1], [0.0] * (n - 2) + [-0.5, -1.5], 0.25, 1.0, version)


@pytest.mark.parametrize("size", [0, 1, 4095, 3 << 20])
def test_file_crc32_is_the_standard_crc32(tmp_path, size):
    """Markers record CRC-32 as zlib computes it, whatever computes it here (any reader can check them)."""
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    (tmp_path / "f").write_bytes(data)
    assert file_crc32(tmp_path / "f") == zlib.crc32(data)


def test_batch_round_trip(tmp_path):
    paths = RunPaths(tmp_path)
    batch = [[sample(5), sample(7, version=2)], [sample(3)]]
    write_batch(paths, 3, batch)
    assert stable_steps(paths.rollouts_root) == [3]
    assert read_batch(paths, 3, 0) == batch[0]
    assert read_batch(paths, 3, 1) == batch[1]
    assert not list(paths.rollouts_root.glob(".*tmp*")), "temporary directory left behind"


def test_teacher_logprobs_round_trip_and_are_all_or_none(tmp_path):
    from dataclasses import replace

    from rl.samples import check_batch, encode_samples

    paths = RunPaths(tmp_path)
    scored = [replace(sample(n), teacher_logprobs=[-0.25 * i for i in range(n)]) for n in (4, 6)]
    write_batch(paths, 0, [scored])
    assert read_batch(paths, 0, 0) == scored
    with pytest.raises(ValueError, match="1 of 2 samples lack the teacher logprobs the others have"):
        encode_samples([scored[0], sample(3)])
    tensors = encode_samples(scored)
    tensors["teacher_logprobs"] = tensors["teacher_logprobs"][:-1]
    with pytest.raises(ValueError, match="teacher_logprobs has 9 entries for 10 tokens"):
        check_batch(tensors)
    with pytest.raises(ValueError, match="teacher_logprobs must have one entry per token"):
        Sample([1, 2], [0, 1], [0.0, -1.0], 0.0, 0.0, 0, [-1.0])


def test_the_teachers_top_k_round_trips_as_tokens_by_k_and_is_all_or_none(tmp_path):
    from dataclasses import replace

    from rl.samples import check_batch, encode_samples

    def ranked(n):
        return replace(sample(n), teacher_logprobs=[-0.5] * n, teacher_top_ids=[[i, i + 1, i + 2] for i in range(n)],
                       teacher_top_logprobs=[[-0.25, -0.5, -3.0]] * n)  # exact in float32

    paths = RunPaths(tmp_path)
    scored = [ranked(4), ranked(6)]
    write_batch(paths, 0, [scored])
    assert read_batch(paths, 0, 0) == scored
    tensors = encode_samples(scored)
    assert tensors["teacher_top_ids"].shape == tensors["teacher_top_logprobs"].shape == (10, 3)
    with pytest.raises(ValueError, match="1 of 2 samples lack the teacher's top-k the others have"):
        encode_samples([scored[0], replace(sample(3), teacher_logprobs=[-0.5] * 3)])
    for name, broken, message in (
        ("teacher_top_ids", tensors["teacher_top_ids"][:-1], "teacher_top_ids has 9 entries for 10 tokens"),
        ("teacher_top_ids", tensors["teacher_top_ids"][:, :2], r"\[10, 2\] and teacher_top_logprobs \[10, 3\]"),
        ("teacher_top_logprobs", tensors["teacher_top_logprobs"].flatten(), "must be two-dimensional"),
    ):
        with pytest.raises(ValueError, match=message):
            check_batch(tensors | {name: broken})
    with pytest.raises(ValueError, match="without the other"):
        check_batch({k: v for k, v in tensors.items() if k != "teacher_top_logprobs"})
    with pytest.raises(ValueError, match="rows must all hold the same k > 0 entries"):
        Sample([1, 2], [0, 1], [0.0, -1.0], 0.0, 0.0, 0, None, [[1, 2], [3]], [[-1.0, -2.0], [-1.0]])
    with pytest.raises(ValueError, match="come together"):
        Sample([1, 2], [0, 1], [0.0, -1.0], 0.0, 0.0, 0, None, [[1], [3]])


def test_token_versions_round_trip_where_every_sample_has_them(tmp_path):
    from dataclasses import replace

    from rl.samples import check_batch, decode_samples, encode_samples

    paths = RunPaths(tmp_path)
    versioned = [replace(sample(4, version=3), token_versions=[3, 3, 3, 4]), replace(sample(3), token_versions=[0] * 3)]
    write_batch(paths, 0, [versioned])
    assert read_batch(paths, 0, 0) == versioned
    tensors = encode_samples(versioned)
    assert tensors["token_policy_versions"].tolist() == [3, 3, 3, 4, 0, 0, 0]
    assert "token_policy_versions" not in encode_samples([versioned[0], sample(3)])  # not every sample has them
    assert decode_samples(encode_samples([sample(3)]))[0].token_versions is None
    for broken, message in (
        (tensors["token_policy_versions"][:-1], "token_policy_versions has 6 entries for 7 tokens"),
        (tensors["token_policy_versions"].float(), "token_policy_versions must be int64"),
        (tensors["token_policy_versions"][None], "token_policy_versions must be one-dimensional"),
    ):
        with pytest.raises(ValueError, match=message):
            check_batch(tensors | {"token_policy_versions": broken})
    with pytest.raises(ValueError, match="token_versions must have one entry per token"):
        Sample([1, 2], [0, 1], [0.0, -1.0], 0.0, 0.0, 0, token_versions=[0])


def test_unstable_directory_is_not_a_step(tmp_path):
    paths = RunPaths(tmp_path)
    paths.weights(2).mkdir(parents=True)
    assert stable_steps(paths.weights_root) == []


def test_corrupt_batch_is_rejected(tmp_path):
    paths = RunPaths(tmp_path)
    write_batch(paths, 0, [[sample(5)]])
    path = paths.rollout_file(0, 0)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="corrupt.*truncated"):
        read_batch(paths, 0, 0)


def test_batch_changed_after_publication_is_rejected(tmp_path):
    """A flipped byte in the data leaves a valid safetensors file: only the marker's CRC-32 catches it."""
    paths = RunPaths(tmp_path)
    write_batch(paths, 0, [[sample(5)]])
    path = paths.rollout_file(0, 0)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC-32"):
        read_batch(paths, 0, 0)


def test_marker_lists_files_and_verifies(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "sub" / "b.bin").write_bytes(b"defg")
    (tmp_path / ".a.bin.tmp123").write_bytes(b"half")  # a writer's temporary file is not part of it
    mark_stable(tmp_path, step=3)
    verify_stable(tmp_path)
    with pytest.raises(CorruptFileError, match="not listed"):
        verify_stable(tmp_path, ["other.bin"])
    (tmp_path / "sub" / "b.bin").unlink()
    with pytest.raises(CorruptFileError, match="b.bin is listed .* but missing"):
        verify_stable(tmp_path)


def test_hand_made_marker_vouches_only_for_completeness(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / STABLE).touch()
    verify_stable(tmp_path)
    (tmp_path / STABLE).write_text("{not json")
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        verify_stable(tmp_path)


def test_wait_for_stable_times_out_naming_what(tmp_path):
    with pytest.raises(TimeoutError, match="the batch for step 4"):
        wait_for_stable(tmp_path / "step_4", 0.2, "the batch for step 4")


def test_wait_for_stable_returns_when_marker_appears(tmp_path):
    paths = RunPaths(tmp_path)
    threading.Timer(0.2, lambda: write_batch(paths, 1, [[sample(4)]])).start()
    start = time.monotonic()
    wait_for_stable(paths.rollouts(1), 5, "step 1")
    assert time.monotonic() - start < 4


def test_sample_lengths_must_agree():
    with pytest.raises(ValueError):
        Sample([1, 2], [1], [0.0, 0.0], 0.0, 0.0, 0)


def test_rescored_logprobs_round_trip_and_are_all_or_none(tmp_path):
    from dataclasses import replace

    from rl.samples import encode_samples

    paths = RunPaths(tmp_path)
    rescored = [replace(sample(n), rescored_logprobs=[-0.5 * i for i in range(n)]) for n in (3, 5)]
    write_batch(paths, 0, [rescored])
    assert read_batch(paths, 0, 0) == rescored
    with pytest.raises(ValueError, match="1 of 2 samples lack the rescored logprobs the others have"):
        encode_samples([rescored[0], sample(3)])
    with pytest.raises(ValueError, match="rescored_logprobs must have one entry per token"):
        replace(sample(3), rescored_logprobs=[0.0])
