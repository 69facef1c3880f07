import pytest

from rl.config import ConfigError
from rl.launcher.devices import split_gpus


def test_counts_give_inference_the_first_gpus():
    plan = split_gpus(8, trainer_gpus=4, inference_gpus=4)
    assert plan.inference_gpus == [[0], [1], [2], [3]]
    assert plan.trainer_gpus == [4, 5, 6, 7] and plan.trainer_processes == 4


def test_tensor_parallel_groups_make_replicas():
    plan = split_gpus(8, trainer_gpus=4, inference_gpus=4, tensor_parallel_size=2)
    assert plan.inference_gpus == [[0, 1], [2, 3]] and plan.replicas == 2


def test_explicit_ids():
    plan = split_gpus(4, trainer_gpu_ids=[0, 2], inference_gpu_ids=[1, 3])
    assert plan.trainer_gpus == [0, 2] and plan.inference_gpus == [[1], [3]]


def test_one_count_takes_the_rest():
    plan = split_gpus(4, inference_gpus=1)
    assert plan.inference_gpus == [[0]] and plan.trainer_gpus == [1, 2, 3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(trainer_gpus=4, inference_gpus=8), "only 8 are visible"),
        (dict(trainer_gpu_ids=[0, 9], inference_gpu_ids=[1]), "do not exist"),
        (dict(trainer_gpu_ids=[0, 1], inference_gpu_ids=[1]), "overlap"),
        (dict(trainer_gpu_ids=[0, 0], inference_gpu_ids=[1]), "twice"),
        (dict(trainer_gpus=5, inference_gpus=3, tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(trainer_gpus=8, inference_gpus=0), "at least one GPU"),
    ],
)
def test_impossible_splits_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        split_gpus(8, **kwargs)
