"""Weight fingerprints (no vLLM): exact sampled columns, the wire format a worker's reply crosses vLLM's
process boundary in, and the comparison the server makes of served against file fingerprints."""

import pytest
import torch

from rl.inference.worker import Fingerprint, probe_inputs, tensor_fingerprint, verified


def reply_serving(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """A worker's reply as `rl_served_weights` makes it, for a model serving `tensors` exactly."""
    served = {name: tensor_fingerprint(t, dtype).to_wire() for name, t in tensors.items()}
    return {"ok": True, "served": served, "dtype": str(dtype).removeprefix("torch."), "tied": False, "verify_s": 0.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_part_is_the_sampled_columns_bit_for_bit(dtype):
    w = torch.randn(300, 77)
    cols, _ = probe_inputs(77, dtype)
    assert torch.equal(tensor_fingerprint(w, dtype).exact, w[:, cols].to(dtype).T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wire_round_trip_is_exact(dtype):
    for t in (torch.randn(40, 24), torch.randn(24), torch.zeros(0)):
        print_ = tensor_fingerprint(t, dtype)
        back = Fingerprint.from_wire(print_.to_wire())
        assert torch.equal(back.exact, print_.exact) and back.exact.dtype == print_.exact.dtype
        assert (back.dense is None) == (print_.dense is None)
        assert back.dense is None or torch.equal(back.dense, print_.dense)
        assert (back.shape, back.scale) == (print_.shape, print_.scale)


def test_served_weights_are_compared_with_the_files():
    tensors = {"a.weight": torch.randn(16, 8), "a.bias": torch.randn(16)}
    files = ({name: tensor_fingerprint(t, torch.float32) for name, t in tensors.items()}, "files-checksum")
    report = verified(reply_serving(tensors, torch.float32), files, torch.float32)
    assert report["ok"] and report["max_exact_diff"] == 0 and "served" not in report
    assert report["checksum"] == "files-checksum"

    stale = dict(tensors, **{"a.weight": tensors["a.weight"] + 1e-3})  # an update that did not arrive
    report = verified(reply_serving(stale, torch.float32), files, torch.float32)
    assert not report["ok"] and "a.weight" in report["differing"][0]

    poisoned = dict(tensors, **{"a.bias": tensors["a.bias"].clone().index_fill_(0, torch.tensor([3]), float("nan"))})
    report = verified(reply_serving(poisoned, torch.float32), files, torch.float32)
    assert not report["ok"] and "a.bias" in report["differing"][0]

    report = verified(reply_serving(tensors, torch.float32), OSError("unreadable"), torch.float32)
    assert not report["ok"] and "unreadable" in report["mismatched"][0]

    refused = {"ok": False, "reloaded": False, "mismatched": ["not served: b.weight"], "differing": []}
    assert verified(dict(refused), files, torch.float32) == refused


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
