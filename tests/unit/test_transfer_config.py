"""The `[transfer]` union (rl/weights/config.py): files, or a collective with its backend and sparse; the old
one-string spellings still read, each with a message naming the new one."""

import logging

import pytest

from rl.config import ConfigError, parse_config
from rl.launcher.config import RLConfig
from rl.trainer.config import TrainerConfig
from rl.weights import RECEIVERS, SENDERS
from rl.weights.config import OLD_TRANSPORTS, CollectiveTransfer, FilesTransfer


@pytest.mark.parametrize("old, expected", [
    ("filesystem", FilesTransfer()),
    ("gloo", CollectiveTransfer(backend="gloo")),
    ("nccl", CollectiveTransfer(backend="nccl")),
    ("sparse_gloo", CollectiveTransfer(backend="gloo", sparse=True)),
    ("sparse_nccl", CollectiveTransfer(backend="nccl", sparse=True)),
    ("collective", CollectiveTransfer()),
    ("sparse", CollectiveTransfer(sparse=True)),
])
def test_each_old_spelling_reads_as_its_variant_and_says_the_new_one(old, expected, caplog):
    with caplog.at_level(logging.WARNING):
        config = parse_config(TrainerConfig, ["--transfer.transport", old])
    assert config.transfer == expected
    assert f'transfer.transport = "{old}" is the old spelling of transfer.type = "{expected.type}"' in caplog.text
    assert set(OLD_TRANSPORTS) == {"filesystem", "gloo", "nccl", "sparse_gloo", "sparse_nccl", "collective", "sparse"}


def test_an_unknown_old_spelling_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"transfer.transport = 'tcp' is none of \['collective', 'filesystem'"):
        parse_config(TrainerConfig, ["--transfer.transport", "tcp"])


def test_a_backend_or_sparse_alone_means_a_collective_and_nothing_means_files():
    assert parse_config(TrainerConfig, []).transfer == FilesTransfer()
    assert parse_config(TrainerConfig, ["--transfer.backend", "gloo"]).transfer == CollectiveTransfer(backend="gloo")
    assert parse_config(TrainerConfig, ["--transfer.sparse", "true"]).transfer == CollectiveTransfer(sparse=True)


def test_a_wire_setting_on_files_is_refused_naming_it_and_an_exported_secret_is_not():
    with pytest.raises(ConfigError, match='transfer.timeout_s is a setting of transfer.type = "collective"'):
        parse_config(TrainerConfig, ["--transfer.timeout-s", "5"])
    with pytest.raises(ConfigError, match='transfer.host is a setting of transfer.type = "collective"'):
        parse_config(TrainerConfig, ["--transfer.type", "filesystem", "--transfer.host", "10.0.0.1"])
    assert parse_config(TrainerConfig, ["--transfer.secret", "s" * 32]).transfer == FilesTransfer()


def test_the_backend_is_resolved_once_and_names_a_registered_transport():
    config = CollectiveTransfer()
    with pytest.raises(ConfigError, match="transfer.backend = 'auto' is resolved on the process's device"):
        config.way
    assert config.resolve_device("cpu", "trainer") == "auto: CPU" and config.way == "gloo"
    assert config.resolve_device("cpu", "trainer") == "set by you"  # resolved: kept
    assert config.engine == "gloo" and CollectiveTransfer(backend="nccl", sparse=True).engine == "sparse_nccl"
    for engine in ("filesystem", "gloo", "nccl", "sparse_gloo", "sparse_nccl"):
        SENDERS.load(engine)  # registered: a sender (and a receiver where a server takes steps itself)
        assert (RECEIVERS.load(engine) is None) == (engine == "filesystem")
    assert FilesTransfer().way == "filesystem" and FilesTransfer().key() is None


def test_the_launchers_transfer_replaces_each_processs_default_and_refuses_a_contradiction(tmp_path):
    from rl.launcher.resolve import resolve
    from rl.launcher.devices import DevicePlan
    from rl.launcher.placement import given_host

    def resolved(*argv):
        config = parse_config(RLConfig, ["--output-dir", str(tmp_path), *argv])
        return resolve(config, given_host(config, DevicePlan(1, [], [[]])))

    r = resolved("--transfer.backend", "gloo", "--transfer.sparse", "true")
    assert {(s.transfer.way, s.transfer.sparse) for s in (r.trainer, r.orchestrator, r.inference)} == {("gloo", True)}
    with pytest.raises(ConfigError, match=r"--transfer \(CollectiveTransfer\) contradicts trainer.transfer"):
        resolved("--transfer.backend", "gloo", "--trainer.transfer.type", "filesystem")
