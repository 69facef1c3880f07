"""`plan(run, topology)`: every host's roles, devices, servers, trainer rank and rendezvous, for 1-4 hosts on
GPUs and CPUs, the trainer beside inference or on hosts of its own."""

import pytest

from rl.config import ConfigError, parse_config
from rl.launcher.config import RLConfig
from rl.launcher.placement import PlacementConfig, plan
from rl.weights.config import FilesTransfer


def run(*argv: str) -> RLConfig:
    return parse_config(RLConfig, list(argv))


def topology(hosts: int, **fields) -> PlacementConfig:
    return PlacementConfig(hosts=[f"h{i}" for i in range(hosts)], **fields)


def servers(host) -> int:
    return host.devices.replicas


def test_one_cpu_host_runs_everything_as_a_single_host_would():
    (host,) = plan(run("--trainer-processes", "2", "--inference-replicas", "2"), topology(1, trainer_hosts=0))
    assert host.roles == ("inference", "orchestrator", "trainer")
    assert (host.devices.trainer_processes, servers(host), host.trainer_nodes) == (2, 2, 1)
    assert host.inference_urls == ("http://h0:8000", "http://h0:8001")
    assert host.rdzv_endpoint is None and host.node_rank == 0 and host.inference_bind == "0.0.0.0"


def test_one_gpu_host_splits_its_gpus_as_the_flags_say():
    (host,) = plan(run("--trainer-gpus", "6", "--inference-gpus", "2"), topology(1, trainer_hosts=0, inference_gpus=8))
    assert host.devices.inference_gpus == [[0], [1]] and host.devices.trainer_gpus == [2, 3, 4, 5, 6, 7]
    assert len(host.inference_urls) == 2


def test_two_gpu_hosts_inference_and_a_trainer_apart():
    first, second = plan(run(), topology(2, inference_gpus=4, trainer_gpus=8))
    assert (first.roles, second.roles) == (("inference", "orchestrator"), ("trainer",))
    assert servers(first) == 4 and first.devices.trainer_gpus == []
    assert first.devices.trainer_processes == 8  # the orchestrator writes a batch per trainer rank
    assert second.devices.trainer_gpus == list(range(8)) and second.trainer_nodes == 1
    assert second.rdzv_endpoint is None and second.inference_urls == ()


def test_three_hosts_with_the_trainer_beside_inference_list_each_hosts_own_servers():
    hosts = plan(run(), topology(3, inference_hosts=3, trainer_hosts=0, inference_gpus=4, trainer_gpus=4))
    assert [servers(h) for h in hosts] == [2, 4, 4]
    assert [h.roles for h in hosts] == [("inference", "orchestrator", "trainer"), ("inference",), ("inference",)]
    urls = hosts[0].inference_urls
    assert len(urls) == 10 and urls[:3] == ("http://h0:8000", "http://h0:8001", "http://h1:8000")
    assert [h.inference_urls for h in hosts[1:]] == [(), ()]


def test_four_hosts_an_orchestrator_of_its_own_and_two_trainer_nodes_meeting_at_the_first():
    hosts = plan(run("--inference.port", "9000"),
                 topology(4, inference_hosts=1, orchestrator_host=True, trainer_hosts=2,
                          inference_gpus=2, trainer_gpus=8))
    assert [h.roles for h in hosts] == [("inference",), ("orchestrator",), ("trainer",), ("trainer",)]
    assert hosts[1].inference_urls == ("http://h0:9000", "http://h0:9001")
    assert hosts[1].devices.trainer_processes == 8 and hosts[1].inference_bind is None
    trainers = [(h.node_rank, h.rdzv_endpoint, h.node_addr) for h in hosts[2:]]
    assert trainers == [(0, "h2:29400", "h2"), (1, "h2:29400", "h3")]
    assert all(h.trainer_nodes == 2 and h.spans_hosts for h in hosts)


def test_cpu_hosts_take_processes_and_replicas_from_the_run():
    hosts = plan(run("--trainer-processes", "3", "--inference-replicas", "2"),
                 topology(3, inference_hosts=1, trainer_hosts=2))
    assert [h.devices.trainer_processes for h in hosts] == [3, 3, 3]
    assert servers(hosts[0]) == 2 and hosts[0].devices.device == "cpu"


@pytest.mark.parametrize("fields, named", [
    (dict(hosts=["a", "b"], inference_hosts=1, trainer_hosts=2), "hosts lists 2 addresses for 3 hosts"),
    (dict(hosts=["a"], trainer_hosts=0, index=1), "index 1 is not one of the 1 hosts"),
])
def test_a_topology_that_does_not_add_up_is_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        PlacementConfig(**fields)


def test_a_gpu_split_the_first_host_cannot_make_is_refused_naming_it():
    with pytest.raises(ConfigError, match="only 4 are visible"):
        plan(run("--trainer-gpus", "4", "--inference-gpus", "4"), topology(1, trainer_hosts=0, inference_gpus=4))


def test_a_placed_host_refuses_flags_that_would_place_it_again():
    from rl.launcher.main import load

    with pytest.raises(ConfigError, match="--roles would place it again"):
        load(["--placement.hosts", '["a", "b"]', "--placement.index", "0", "--roles", '["trainer"]',
              "--inference.admin-token", "t"])
    with pytest.raises(ConfigError, match="--placement.index"):
        load(["--placement.hosts", '["a", "b"]', "--inference.admin-token", "t"])


@pytest.mark.parametrize("tp, groups", [
    (1, [[0], [1], [2], [3], [4], [5], [6], [7]]),
    (2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_an_inference_host_of_8_gpus_runs_a_server_per_tp_group_on_consecutive_ports(tp, groups):
    first, _ = plan(run("--inference.tensor-parallel-size", str(tp)), topology(2, inference_gpus=8, trainer_gpus=8))
    assert first.devices.inference_gpus == groups
    assert first.inference_urls == tuple(f"http://h0:{8000 + s}" for s in range(8 // tp))


def test_two_inference_hosts_with_tp_4_keep_each_group_on_its_host():
    hosts = plan(run("--inference.tensor-parallel-size", "4"),
                 topology(3, inference_hosts=2, trainer_hosts=1, inference_gpus=8, trainer_gpus=8))
    assert [h.devices.inference_gpus for h in hosts[:2]] == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2
    assert hosts[0].inference_urls == ("http://h0:8000", "http://h0:8001", "http://h1:8000", "http://h1:8001")
    with pytest.raises(ConfigError, match=r"6 inference GPUs \[0, 1, 2, 3, 4, 5\] do not divide into servers of "
                                          r"inference.tensor_parallel_size = 4 GPUs each: .*placement.inference_gpus"):
        plan(run("--inference.tensor-parallel-size", "4"),
             topology(3, inference_hosts=2, trainer_hosts=1, inference_gpus=6, trainer_gpus=8))


def test_a_tp_size_that_does_not_divide_the_inference_share_of_a_shared_host_is_refused_naming_both():
    shared = topology(1, trainer_hosts=0, inference_gpus=8)
    (host,) = plan(run("--inference.tensor-parallel-size", "2", "--trainer-gpus", "4", "--inference-gpus", "4"), shared)
    assert host.devices.inference_gpus == [[0, 1], [2, 3]] and host.devices.trainer_gpus == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"3 inference GPUs .* inference.tensor_parallel_size = 2 GPUs each"):
        plan(run("--inference.tensor-parallel-size", "2", "--trainer-gpus", "5", "--inference-gpus", "3"), shared)
    with pytest.raises(ConfigError, match=r"2 inference GPUs \[1, 2\] .* = 4 GPUs each"):
        plan(run("--inference.tensor-parallel-size", "4", "--inference-gpu-ids", "[1, 2]", "--trainer-gpu-ids", "[0]"),
             shared)


def test_weights_over_the_wire_reach_the_placed_trainers_first_host_unless_transfer_host_is_set():
    from rl.launcher.resolve import resolve

    wire = ("--transfer.backend", "gloo", "--inference.admin-token", "t", "--transfer.secret", "s" * 32)
    config = run(*wire)
    hosts = plan(config, topology(4, inference_hosts=2, trainer_hosts=2))
    assert {h.trainer_addr for h in hosts} == {"h2"}  # rank 0 of the trainer holds the transfer store
    for host in hosts:  # every host computes the same address, for all three processes
        resolved = resolve(config, host)
        assert {s.transfer.host for s in (resolved.trainer, resolved.orchestrator, resolved.inference)} == {"h2"}
    chosen = run(*wire, "--transfer.host", "10.0.0.7")
    assert resolve(chosen, hosts[0]).trainer.transfer.host == "10.0.0.7"
    assert resolve(run("--inference.admin-token", "t"), hosts[0]).trainer.transfer == FilesTransfer()  # no store


def test_weights_over_the_wire_across_hosts_started_by_hand_need_transfer_host():
    from rl.launcher.resolve import resolve
    from rl.launcher.devices import DevicePlan
    from rl.launcher.placement import given_host

    by_hand = ("--roles", '["trainer"]', "--inference.admin-token", "t", "--transfer.backend", "gloo",
               "--transfer.secret", "s" * 32)
    config = run(*by_hand)
    with pytest.raises(ConfigError, match="need --transfer.host"):
        resolve(config, given_host(config, DevicePlan(1, [], [])))
    config = run(*by_hand, "--transfer.host", "trainer-a")
    assert resolve(config, given_host(config, DevicePlan(1, [], []))).inference.transfer.host == "trainer-a"
    alone = run("--transfer.backend", "gloo")
    assert resolve(alone, given_host(alone, DevicePlan(1, [], [[]]))).trainer.transfer.host == "127.0.0.1"


def test_weights_over_the_wire_get_a_secret_per_run_that_only_trainer_and_servers_hold():
    from rl.launcher.resolve import resolve
    from rl.launcher.devices import DevicePlan
    from rl.launcher.placement import given_host

    def resolved(*argv):
        config = run("--transfer.backend", "gloo", *argv)
        return resolve(config, given_host(config, DevicePlan(1, [], [[]])))

    first, second = resolved(), resolved()
    assert len(first.trainer.transfer.secret) == 64 and first.trainer.transfer.secret == first.inference.transfer.secret
    assert first.orchestrator.transfer.secret is None  # it runs environments' code and sends nothing
    assert second.trainer.transfer.secret != first.trainer.transfer.secret
    given = resolved("--transfer.secret", "s" * 32)
    assert given.inference.transfer.secret == "s" * 32 and given.orchestrator.transfer.secret is None
    hosts = plan(run("--transfer.backend", "gloo", "--inference.admin-token", "t"), topology(2, inference_hosts=1))
    with pytest.raises(ConfigError, match="need the same transfer.secret on every host"):
        resolve(run("--transfer.backend", "gloo", "--inference.admin-token", "t"), hosts[0])
