"""Weight fingerprints (no vLLM): exact sampled columns, the comparison a worker makes of served against file
fingerprints, and reading a published step's files once."""

import json
import os

import pytest
import torch

from rl.inference.fingerprint import compare, probe_inputs, tensor_fingerprint


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

    from rl.inference.fingerprint import checkpoint_fingerprint

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


def staged(directory):
    """The step staged as the server stages it (one handle from the marker to the files), and mapped as a worker
    maps it."""
    from rl.inference.reading import MappedStep
    from rl.inference.staging import stage_weights
    from rl.manifest import OpenDir, read_manifest

    with OpenDir.beneath(directory.parent, directory.name) as handle:
        step = stage_weights(handle, read_manifest(handle))
    return step, MappedStep(step.rpc())


def test_a_step_is_read_once_into_sealed_memory_and_workers_map_the_files_tensors(tmp_path):
    from safetensors.torch import load_file

    shards = [{"a.weight": torch.randn(8, 4), "a.bias": torch.randn(8)},
              {"b.weight": torch.randn(3, 5).bfloat16(), "c.steps": torch.arange(7)}]
    directory = published_step(tmp_path, shards)
    step, mapped = staged(directory)
    try:
        assert mapped.shapes() == {"a.weight": (8, 4), "a.bias": (8,), "b.weight": (3, 5), "c.steps": (7,)}
        tensors = dict(mapped.tensors())
        expected = {**load_file(str(directory / "model-00001-of-00002.safetensors")),
                    **load_file(str(directory / "model-00002-of-00002.safetensors"))}
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[n], expected[n]) and tensors[n].dtype == expected[n].dtype for n in expected)
        weight_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        assert step.bytes == mapped.bytes == weight_bytes  # each weight file read exactly once, headers included
        assert sorted(step.files) == sorted(p.name for p in directory.glob("*.safetensors"))
        fd, _ = step.files["model-00001-of-00002.safetensors"]
        with pytest.raises(PermissionError):  # sealed: not even the server can change what was checked
            os.pwrite(fd, b"x", 0)
    finally:
        step.close()


def test_the_server_takes_the_steps_checksum_as_it_stages_it_and_workers_do_not_hash_it_again(tmp_path,
                                                                                                 monkeypatch):
    """`weights_checksum` is taken once per server, from the bytes it checked (outside the hold on generation), and is
    the same function as the trainer's digest and a model directory's tally, however the step is split in files."""
    from rl.inference.fingerprint import FileTally, checkpoint_fingerprint
    from rl.weights.digest import TensorDigest

    shards = [{"a.weight": torch.randn(8, 4), "a.bias": torch.randn(8)},
              {"b.weight": torch.randn(3, 5).bfloat16(), "c.steps": torch.arange(7)}]
    directory = published_step(tmp_path, shards)
    step, mapped = staged(directory)
    try:
        trainer = TensorDigest()
        for name, tensor in reversed([item for shard in shards for item in shard.items()]):  # any order
            trainer.update(name, tensor)
        assert step.checksum == trainer.hexdigest()
        assert step.checksum == checkpoint_fingerprint(directory, torch.float32, tied=False)[1]
        assert step.rpc()["checksum"] == step.checksum

        hashed = []
        monkeypatch.setattr(TensorDigest, "update", lambda self, name, tensor: hashed.append(name))
        tally = FileTally(torch.float32, checksum=step.rpc()["checksum"])  # as a worker loads a staged step
        assert sorted(name for name, _ in tally.through(mapped.tensors())) == ["a.bias", "a.weight", "b.weight",
                                                                                "c.steps"]
        assert hashed == [] and tally.checksum == step.checksum and set(tally.prints) == set(mapped.shapes())
        for _ in FileTally(torch.float32).through(mapped.tensors()):  # a model directory: hashed as it passes
            pass
        assert len(hashed) == 4
    finally:
        step.close()


def tally_of_a_sharded_and_a_whole_tensor(device: str):
    """A worker's tally of two tensors: `w` of which it serves rows 4..7 (a column-parallel shard), `norm` whole."""
    from rl.inference.fingerprint import FileTally
    from rl.inference.sharding import Shard

    w, norm = torch.randn(8, 6), torch.randn(6)
    tally = FileTally(torch.float32, device, shards={"w": Shard(0, 4, 4)}, checksum="known")
    return tally, {"w": w, "norm": norm}, dict(tally.through(iter([("w", w), ("norm", norm)])))


def test_a_worker_moves_only_its_shard_of_a_sharded_tensor_to_its_device():
    """Each tensor-parallel worker fingerprints its shard on its device and hands the reload the host tensor, which
    vLLM's loader cuts the same shard from: a worker moves its part of the model to its GPU, not all of it (at TP=8
    on a 32B model, 16 GB per update instead of 64 GB per worker, while generation is held)."""
    from rl.inference.fingerprint import tensor_fingerprint

    tally, given, loaded = tally_of_a_sharded_and_a_whole_tensor("cpu")
    assert loaded["w"] is given["w"]  # the whole host tensor, for the loader to cut
    assert tally.device_bytes == (4 * 6 + 6) * 4  # the shard's bytes and the whole norm's
    print_ = tally.prints["w"]
    assert print_.shape == (8, 6) and print_.shard.start == 4 and print_.shard.length == 4
    expected = tensor_fingerprint(given["w"][4:], torch.float32)
    assert torch.equal(print_.exact, expected.exact) and torch.equal(print_.dense, expected.dense)
    assert print_.scale == expected.scale > 0  # the files' side keeps the size of its dense probe's terms


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_sharded_tensor_stays_on_the_host_for_the_loader_and_a_whole_one_moves_once():
    tally, given, loaded = tally_of_a_sharded_and_a_whole_tensor("cuda")
    assert loaded["w"].device.type == "cpu" and loaded["norm"].device.type == "cuda"
    assert tally.device_bytes == (4 * 6 + 6) * 4
    assert torch.equal(tally.prints["w"].exact, given["w"][4:, tally_probe_columns(6)].T)


def tally_probe_columns(n: int) -> list[int]:
    cols, _ = probe_inputs(n, torch.float32)
    return cols


def test_a_steps_memory_is_given_back_off_the_event_loop():
    """Freeing a step's pages takes ~50 ms per 400 MB here (seconds for a 32B model): never on the event loop, where
    it would hold up every request the server answers meanwhile."""
    import asyncio
    import threading

    from rl.inference.staging import StagedStep, release

    fd = os.memfd_create("step")
    os.ftruncate(fd, 4096)
    closed_in = []

    class Recorded(StagedStep):
        def close(self):
            closed_in.append(threading.get_ident())
            super().close()

    step = Recorded({"model.safetensors": (fd, 4096)}, "checksum")

    async def main():
        await release(step)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert closed_in and closed_in[0] != loop_thread and step.files == {}
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_a_weight_file_changed_after_publication_is_refused_before_any_tensor_is_given(tmp_path):
    from rl.manifest import CorruptFileError

    directory = published_step(tmp_path, [{"a.weight": torch.randn(8, 4)}, {"b.weight": torch.randn(4, 4)}])
    second = directory / "model-00002-of-00002.safetensors"
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF
    second.write_bytes(bytes(data))
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CorruptFileError, match="model-00002-of-00002.safetensors fails its CRC-32 check"):
        staged(directory)  # vLLM's reload cannot stop halfway: nothing is given out
    assert len(os.listdir("/proc/self/fd")) == open_before  # nor kept: the first file's memfd is closed


def test_the_step_directory_swapped_for_a_link_after_its_check_is_never_read_through(tmp_path):
    """The race of a rename-exchange after STABLE was read: every later read goes through the handle opened for
    the check, so it reads the directory that was checked (or nothing), never what the path names now."""
    from rl.inference.reading import MappedStep
    from rl.inference.staging import stage_weights
    from rl.manifest import CorruptFileError, OpenDir, read_manifest

    weights = tmp_path / "weights"
    weights.mkdir()
    directory = published_step(weights, [{"a.weight": torch.ones(4, 4)}])
    (tmp_path / "outside").mkdir()
    outside = published_step(tmp_path / "outside", [{"a.weight": torch.zeros(4, 4)}])  # the same size and names
    with OpenDir.beneath(weights, "step_1") as handle:
        manifest = read_manifest(handle)
        directory.rename(weights / "checked")  # the swap, between the check and the read
        (weights / "step_1").symlink_to(outside, target_is_directory=True)
        step = stage_weights(handle, manifest)
    try:
        assert torch.equal(dict(MappedStep(step.rpc()).tensors())["a.weight"], torch.ones(4, 4))
    finally:
        step.close()
    with pytest.raises(CorruptFileError, match="symlink"):  # and the path, opened again, is refused
        OpenDir.beneath(weights, "step_1")


@pytest.mark.parametrize("entries, named", [
    ({"a": ("F32", [4], [0, 16]), "b": ("F32", [4], [16, 32])},
     r"ends at byte 32 of the data, past its end \(24 bytes\)"),
    ({"a": ("F32", [4], [0, 16]), "b": ("F32", [2], [8, 16])}, "overlap"),
])
def test_a_header_placing_a_tensor_past_the_end_or_over_another_is_corrupt(entries, named):
    """A weight file cut short inside its data: its header alone is whole (round 2 let this through to vLLM, whose
    reload stopped halfway)."""
    from rl.manifest import CorruptFileError
    from rl.safetensors_io import tensors_of

    header = json.dumps({name: {"dtype": d, "shape": s, "data_offsets": o} for name, (d, s, o) in entries.items()})
    data = bytearray(len(header).to_bytes(8, "little") + header.encode() + bytes(24))
    with pytest.raises(CorruptFileError, match=named):
        list(tensors_of(data, "f.safetensors"))


def test_a_header_naming_a_tensor_twice_is_corrupt():
    from rl.manifest import CorruptFileError
    from rl.safetensors_io import tensors_of

    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    header = f'{{"a": {entry}, "a": {entry}}}'.encode()
    with pytest.raises(CorruptFileError, match="'a' appears twice"):
        list(tensors_of(bytearray(len(header).to_bytes(8, "little") + header + bytes(4)), "f.safetensors"))


@pytest.mark.parametrize("header", [b"\xff" * 8, b"\x04\x00\x00\x00\x00\x00\x00\x00[1]]",
                                    b'\x30\x00\x00\x00\x00\x00\x00\x00'
                                    b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}'])
def test_a_malformed_safetensors_header_is_a_corrupt_file(header):
    from rl.inference.reading import tensors_of
    from rl.manifest import CorruptFileError

    with pytest.raises(CorruptFileError):
        list(tensors_of(bytearray(header + bytes(16)), "f.safetensors"))


# ---- LoRA adapters: the checks before vLLM loads one, and the read-back of its slot ----

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
QKV, O_PROJ = "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"


class FakeLoraLayer:
    """vLLM's linear LoRA layer as the read-back sees it: per slice, A [slots, 1, max_rank, in], B [slots, 1, out,
    max_rank], and the layer it adapts (unsharded: tensor parallel size 1)."""

    def __init__(self, outs: list[int], in_features: int, max_rank: int = 4, slots: int = 2):
        from types import SimpleNamespace

        self.lora_a_stacked = tuple(torch.zeros(slots, 1, max_rank, in_features) for _ in outs)
        self.lora_b_stacked = tuple(torch.zeros(slots, 1, out, max_rank) for out in outs)
        self.base_layer = SimpleNamespace(output_partition_sizes=outs, output_size=sum(outs), input_size=in_features)


def fake_layers() -> dict:
    return {QKV: FakeLoraLayer([8, 4, 4], 8), O_PROJ: FakeLoraLayer([8], 8),
            "model.embed_tokens": type("Embedding", (), {"lora_a_stacked": torch.zeros(2, 11, 4),
                                                         "lora_b_stacked": torch.zeros(2, 1, 8, 4)})()}


def adapter_tensors(rank: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A rank-`rank` adapter on q_proj, v_proj and o_proj of fake_layers()."""
    from rl.adapter import tensor_name

    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": 8, "self_attn.v_proj": 4, "self_attn.o_proj": 8}
    tensors = {}
    for module, out in shapes.items():
        tensors[tensor_name(f"model.layers.0.{module}", "A")] = torch.randn(rank, 8, generator=g)
        tensors[tensor_name(f"model.layers.0.{module}", "B")] = torch.randn(out, rank, generator=g)
    return tensors


def peft_config(rank: int = 2, alpha: float = 3, **fields) -> dict:
    from rl.adapter import adapter_config

    return adapter_config("base", rank, alpha, 0.0, ["q_proj", "v_proj", "o_proj"]) | fields


def parsed(tensors: dict, layers: dict, rank: int = 2, alpha: float = 3, **fields):
    from rl.inference.adapters import lora_slices, parse_adapter

    return parse_adapter(tensors.items(), peft_config(rank, alpha, **fields), lora_slices(layers, PACKED))


def load_like_vllm(layers: dict, adapter, slot: int) -> None:
    """What vLLM's add_lora leaves in a slot: A, and B cast then scaled in place (its optimize())."""
    from rl.inference.adapters import lora_slices

    for module, where in lora_slices(layers, PACKED).items():
        if module in adapter.pairs:
            a, b = adapter.pairs[module]
            b = b.clone()
            b *= adapter.scaling
            layer = layers[where.layer]
            layer.lora_a_stacked[where.index][slot, 0, : a.shape[0], : a.shape[1]] = a
            layer.lora_b_stacked[where.index][slot, 0, : b.shape[0], : b.shape[1]] = b


def test_the_read_back_passes_exactly_what_the_files_say():
    from rl.inference.adapters import lora_slices, slot_differences

    layers = fake_layers()
    adapter = parsed(adapter_tensors(), layers)
    load_like_vllm(layers, adapter, slot=1)
    assert slot_differences(layers, lora_slices(layers, PACKED), adapter, 1, torch.float32) == []
    # slot 0 holds nothing: every targeted module differs there
    assert len(slot_differences(layers, lora_slices(layers, PACKED), adapter, 0, torch.float32)) == 6


@pytest.mark.parametrize("fault, named", [
    ("changed A element", "model.layers.0.self_attn.v_proj: lora_A served differs"),
    ("B not scaled", "model.layers.0.self_attn.o_proj: lora_B served differs"),
    ("untargeted slice nonzero", f"{QKV} slice 1: not targeted by the adapter, yet nonzero"),
    ("embedding slot nonzero", "model.embed_tokens slice 0: not targeted by the adapter, yet nonzero"),
])
def test_the_read_back_catches_a_slot_that_differs(fault, named):
    from rl.inference.adapters import lora_slices, slot_differences

    layers = fake_layers()
    adapter = parsed(adapter_tensors(), layers)
    load_like_vllm(layers, adapter, slot=1)
    if fault == "changed A element":
        layers[QKV].lora_a_stacked[2][1, 0, 1, 5] += 2**-20
    elif fault == "B not scaled":
        layers[O_PROJ].lora_b_stacked[0][1, 0, :, :2] = adapter.pairs["model.layers.0.self_attn.o_proj"][1]
    elif fault == "untargeted slice nonzero":
        layers[QKV].lora_b_stacked[1][1, 0, 3, 0] = 1e-30
    else:
        layers["model.embed_tokens"].lora_a_stacked[1, 7, 0] = float("nan")
    problems = slot_differences(layers, lora_slices(layers, PACKED), adapter, 1, torch.float32)
    assert len(problems) == 1 and problems[0].startswith(named), problems


def test_the_expected_b_is_vllms_own_scaling_in_the_served_dtype():
    """vLLM folds alpha / r into B in the served dtype; the read-back computes the same product, so bf16 matches
    bit for bit (a product in float32 then cast would round differently for some elements)."""
    from vllm.lora.lora_weights import LoRALayerWeights

    from rl.inference.adapters import expected_slot

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 16, generator=g), torch.randn(32, 3, generator=g)
    vllm_side = LoRALayerWeights("m", rank=3, lora_alpha=7, lora_a=a.bfloat16(), lora_b=b.bfloat16()).optimize()
    slot_a, slot_b = expected_slot(a, b, 7 / 3, torch.bfloat16, max_rank=8)
    assert torch.equal(slot_b[:, :3], vllm_side.lora_b) and torch.equal(slot_a[:3], vllm_side.lora_a)
    assert not slot_b[:, 3:].any() and not slot_a[3:].any()


def renamed(tensors: dict, old: str, new: str) -> dict:
    return {name.replace(old, new): t for name, t in tensors.items()}


BAD_ADAPTERS = [
    ("not PEFT LoRA", lambda t: t | {"base_model.model.model.norm.weight": torch.ones(8)}, "is not a LoRA tensor name"),
    ("no such module", lambda t: renamed(t, "o_proj", "out_proj"),
     "module 'model.layers.0.self_attn.out_proj' maps to no LoRA layer"),
    ("embedding", lambda t: renamed(t, "self_attn.o_proj", "embed_tokens"), "maps to no LoRA layer"),
    ("A without B", lambda t: {n: v for n, v in t.items() if "o_proj.lora_B" not in n},
     "o_proj: lora_A.weight without its lora_B"),
    ("B too tall", lambda t: t | {"base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight": torch.zeros(8, 2)},
     "v_proj: lora_B is [8, 2], the layer takes [out=4, r=2]"),
    ("rank other than r", lambda t: t | {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                                         torch.zeros(3, 8)},
     "q_proj: lora_A is [3, 8], the layer takes [r=2, in=8]"),
    ("targets nothing", lambda t: {}, "the adapter targets nothing"),
    ("inf in lora_A", lambda t: t | {"base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight":
                                     torch.full((2, 8), float("inf"))},
     "o_proj.lora_A.weight: holds values that are not finite"),
    ("NaN in lora_B", lambda t: t | {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                                     torch.full((8, 2), float("nan"))},
     "q_proj.lora_B.weight: holds values that are not finite"),
]


@pytest.mark.parametrize("change, named", [c[1:] for c in BAD_ADAPTERS], ids=[c[0] for c in BAD_ADAPTERS])
def test_an_adapter_that_does_not_fit_is_refused_naming_why(change, named):
    from rl.inference.adapters import AdapterMismatch

    with pytest.raises(AdapterMismatch) as refused:
        parsed(change(adapter_tensors()), fake_layers())
    assert any(named in problem for problem in refused.value.problems), refused.value.problems


@pytest.mark.parametrize("config, named", [
    ({"r": 8, "lora_alpha": 16}, "rank 8 is above the server's max rank 4"),
    ({"use_rslora": True}, "sets use_rslora: not a plain LoRA"),
    ({"r": "2"}, "r is '2', not a positive integer"),
    ({"lora_alpha": None}, "lora_alpha is None"),
    ({"lora_alpha": 1e30}, "lora_alpha / r is 5e\\+29, above 1024"),
    ({"peft_type": "IA3"}, "peft_type is 'IA3', not 'LORA'"),
    ({"peft_type": None}, "peft_type is None"),
    ({"target_modules": ["q_proj", "out_proj"]}, "target module 'out_proj' matches no LoRA layer"),
    ({"target_modules": ".*embed_tokens"}, "matches no LoRA layer served"),
    ({"target_modules": 7}, "target_modules is 7"),
    ({"layers_to_transform": [5]}, "layers_to_transform is \\[5\\], not indices of the served layers \\(0..0\\)"),
    ({"layers_to_transform": "0"}, "layers_to_transform is '0'"),
])
def test_an_adapter_config_vllm_would_serve_otherwise_is_refused(config, named):
    from rl.inference.adapters import AdapterMismatch, lora_slices, parse_adapter

    with pytest.raises(AdapterMismatch, match=named):
        parse_adapter(adapter_tensors().items(), peft_config() | config, lora_slices(fake_layers(), PACKED))


def test_an_adapter_config_peft_writes_for_these_layers_is_accepted():
    assert parsed(adapter_tensors(), fake_layers(), layers_to_transform=[0]).rank == 2
    assert parsed(adapter_tensors(), fake_layers(), target_modules=r".*\.(q|v|o)_proj").rank == 2
    assert parsed(adapter_tensors(), fake_layers(), target_modules="q_proj").rank == 2


def test_an_adapter_step_is_read_once_and_checked(tmp_path):
    from safetensors.torch import save_file

    from rl.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config_bytes
    from rl.inference.reading import ReadCount, read_adapter
    from rl.manifest import CorruptFileError, mark_stable, read_manifest

    tensors = adapter_tensors()
    directory = tmp_path / "step_1"
    directory.mkdir()
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_bytes(adapter_config_bytes("base", 2, 3, 0.0, ["q_proj"]))
    mark_stable(directory, step=1)
    count = ReadCount()
    read, config = read_adapter(directory, read_manifest(directory), count)
    assert dict(read).keys() == tensors.keys() and all(torch.equal(dict(read)[n], t) for n, t in tensors.items())
    assert (config["r"], config["lora_alpha"]) == (2, 3)
    assert count.data_bytes == (directory / ADAPTER_WEIGHTS).stat().st_size
    data = bytearray((directory / ADAPTER_WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (directory / ADAPTER_WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="fails its CRC-32 check"):
        read_adapter(directory, read_manifest(directory), ReadCount())


def test_a_safetensors_file_written_in_one_pass_reads_back_with_its_crc():
    """The trainer's writer takes each shard's size and CRC-32 as it writes it (nobody reads the shard again to
    mark the step); the safetensors library reads the file back exactly, every tensor aligned for its dtype."""
    import tempfile
    import zlib

    from safetensors.torch import load_file

    from rl.safetensors_io import write_file

    tensors = {"b.weight": torch.randn(3, 5).bfloat16(), "a": torch.arange(7), "c": torch.randn(4),
               "empty": torch.empty(0), "odd": torch.ones(3, dtype=torch.uint8)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        size, crc = write_file(path, tensors, {"format": "pt"})
        data = open(path, "rb").read()
        assert (size, crc) == (len(data), zlib.crc32(data))
        back = load_file(path)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], t) and back[n].dtype == t.dtype for n, t in tensors.items())
