import pytest

from rl.orchestrator.advantage import grpo_advantages
from rl.orchestrator.batch import balance_by_tokens
from rl.orchestrator.sampler import TaskSampler
from rl.protocol import Sample


def test_grpo_by_hand():
    # mean 0.5, population std 0.5
    assert grpo_advantages([1.0, 0.0, 1.0, 0.0]) == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert grpo_advantages([0.3, 0.3]) == [0.0, 0.0]


def test_sampler_draws_each_task_once_per_epoch_and_resumes():
    sampler = TaskSampler(10, seed=1)
    first = sampler.draw(10)
    assert sorted(first) == list(range(10))
    resumed = TaskSampler(**{**sampler.state_dict()})
    assert resumed.draw(4) == sampler.draw(4)
    assert sampler.epoch == 1


def test_balance_by_tokens_equal_counts_and_close_tokens():
    samples = [Sample([0] * n, [1] * n, [0.0] * n, 0.0, 0.0, 0) for n in (10, 9, 8, 1, 1, 1)]
    buckets = balance_by_tokens(samples, 2)
    assert [len(b) for b in buckets] == [3, 3]
    tokens = [sum(len(s.input_ids) for s in b) for b in buckets]
    assert abs(tokens[0] - tokens[1]) <= 10
    with pytest.raises(ValueError):
        balance_by_tokens(samples[:5], 2)


class _UnhashableFactory:
    __hash__ = None

    def __call__(self) -> list:
        return ["made"]


def test_default_factories_behave_the_same_with_their_inspection_cached():
    """rollouts caches pydantic's per-construct inspection of default factories (a CPU hot spot); every
    kind of factory must still give what pydantic gives."""
    from pydantic import BaseModel, Field
    from pydantic._internal import _fields

    import rl.orchestrator.rollouts  # noqa: F401 - installs the cache

    class Model(BaseModel):
        a: int = 1
        plain: list = Field(default_factory=list)
        from_data: int = Field(default_factory=lambda data: data["a"] * 2)
        odd: list = Field(default_factory=_UnhashableFactory())

    hits = _fields.takes_validated_data_argument.cache_info().hits
    for _ in range(3):
        made = Model.model_construct(a=5)
        assert (made.plain, made.from_data, made.odd) == ([], 10, ["made"])
    assert Model(a=4).from_data == 8
    assert _fields.takes_validated_data_argument.cache_info().hits > hits


def test_gc_tuned_for_serving_freezes_the_startup_heap_and_collects_young_objects_less_often():
    import gc

    from rl.orchestrator.rollouts import YOUNG_GC_THRESHOLD, tune_gc_for_serving

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])  # CPython's default; an in-process orchestrator test may have tuned it
        tune_gc_for_serving()
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
