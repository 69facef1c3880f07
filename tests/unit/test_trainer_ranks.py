"""rl.trainer.ranks: torchrun's flags, the rendezvous torchrun would pick for them, the ranks forked (started here by
a stand-in for torch's elastic_launch; tests/integration/test_trainer.py runs real ones)."""

import pytest
import torch.distributed.launcher.api as launcher_api

from rl.trainer import ranks


@pytest.fixture
def launched(monkeypatch) -> list:
    calls = []

    def elastic_launch(config, entrypoint):
        return lambda *args: calls.append((config, entrypoint, args))

    monkeypatch.setattr(launcher_api, "elastic_launch", elastic_launch)
    return calls


def test_standalone_ranks_are_forked_into_the_trainer_with_its_flags(launched):
    ranks.launch(["--standalone", "--nproc-per-node=2", "-m", "rl.trainer.main", "@", "t.toml", "--max-steps", "3"])
    ((config, entrypoint, args),) = launched
    assert (config.nproc_per_node, config.start_method) == (2, "fork")
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "localhost:0") and config.run_id
    assert entrypoint is ranks.run_rank and args == ("rl.trainer.main", "@", "t.toml", "--max-steps", "3")


def test_a_given_master_port_keeps_torchruns_static_rendezvous(launched):
    ranks.launch(["--nproc-per-node=2", "--master-port", "29611", "-m", "rl.trainer.main"])
    ((config, _, _),) = launched
    assert (config.rdzv_backend, config.rdzv_endpoint, config.start_method) == ("static", "127.0.0.1:29611", "fork")


def test_only_the_trainer_is_run(launched):
    only = "runs `-m rl.trainer.main ...` or `-m rl.trainer.service ...` only, not 'rl.trainer.sft'"
    with pytest.raises(SystemExit, match=only):
        ranks.launch(["--standalone", "--nproc-per-node=2", "-m", "rl.trainer.sft"])
    assert not launched
