import json

import pytest

from rl.orchestrator.batch import to_sample
from rl.envs.rollouts import TokenSegment
from rl.orchestrator.sampler import TaskSampler
from rl.orchestrator.state import load_state, restore_samplers, save_state
from rl.protocol import RunPaths, mark_stable


def draw_steps(samplers, steps, per_step=3):
    return [[sampler.draw(per_step) for sampler in samplers] for _ in range(steps)]


def test_resume_draws_the_same_tasks_as_an_uninterrupted_run(tmp_path):
    paths = RunPaths(tmp_path)
    straight = [TaskSampler(7, seed=0), TaskSampler(5, seed=1)]
    expected = draw_steps(straight, 6)

    first = [TaskSampler(7, seed=0), TaskSampler(5, seed=1)]
    before = draw_steps(first, 4)
    save_state(paths, 4, policy_step=3, samplers=first, keep=2)
    state = load_state(paths, 4)
    assert state["step"] == 4 and state["policy_step"] == 3
    resumed = restore_samplers(state, [TaskSampler(7, seed=0), TaskSampler(5, seed=1)])
    assert before + draw_steps(resumed, 2) == expected


def test_no_task_twice_within_an_epoch_across_a_resume(tmp_path):
    paths = RunPaths(tmp_path)
    sampler = TaskSampler(10, seed=3)
    drawn = sampler.draw(4)
    save_state(paths, 1, 0, [sampler], keep=1)
    (resumed,) = restore_samplers(load_state(paths, 1), [TaskSampler(10, seed=3)])
    drawn += resumed.draw(6)  # the rest of epoch 0
    assert sorted(drawn) == list(range(10))


def test_resume_rejects_missing_state_and_changed_envs(tmp_path):
    paths = RunPaths(tmp_path)
    with pytest.raises(ValueError, match="resume_step=2"):
        load_state(paths, 2)
    save_state(paths, 2, 1, [TaskSampler(10, seed=0)], keep=1)
    with pytest.raises(ValueError, match="20 tasks"):
        restore_samplers(load_state(paths, 2), [TaskSampler(20, seed=0)])


def test_save_state_keeps_the_last_n_complete(tmp_path):
    paths = RunPaths(tmp_path)
    for step in (1, 2, 3):
        save_state(paths, step, 0, [TaskSampler(4, seed=0)], keep=2)
    assert (paths.checkpoint(1) / "orchestrator").exists()  # no trainer part yet: nothing is complete
    for step in (2, 3):  # the trainer catches up
        (paths.checkpoint(step) / "trainer").mkdir()
        mark_stable(paths.checkpoint(step) / "trainer")
    save_state(paths, 4, 0, [TaskSampler(4, seed=0)], keep=2)
    assert not (paths.checkpoint(1) / "orchestrator").exists()
    assert json.loads((paths.checkpoint(3) / "orchestrator" / "state.json").read_text())["step"] == 3


def segment(mask):
    n = len(mask)
    return TokenSegment([1, 2], list(range(n)), mask, [-0.5] * n)


def test_environment_tokens_stay_masked_and_masked_rollouts_train_nothing():
    # turn 1 sampled (2 tokens), environment reply (3 tokens), turn 2 sampled (1 token)
    sample = to_sample(segment([1, 1, 0, 0, 0, 1]), reward=1.0, advantage=0.5, dispatched=2)
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 0, 1]
    assert sample.policy_version == 2
    assert to_sample(segment([1, 1, 0, 1]), 1.0, 0.5, 2, trainable=False).loss_mask == [0] * 6


def test_branches_sharing_a_sampled_node_train_it_once():
    from types import SimpleNamespace as NS

    from rl.envs.rollouts import to_segments

    def branch(*nodes):
        ids = [t for n in nodes for t in n.token_ids]
        mask = [m for n in nodes for m in n.mask]
        return NS(nodes=list(nodes), token_ids=ids, sampled_mask=mask, logprobs=[-0.1 if m else 0.0 for m in mask],
                  routed_experts=None, messages=[])  # a dense text model's: no routing, no images

    def node(ids, mask):
        return NS(token_ids=ids, mask=mask, loss_weights=None)

    prompt = node([1, 2], [False, False])
    turn1 = node([3, 4], [True, True])
    env_a, turn2a = node([5], [False]), node([6], [True])
    rerender, turn2b = node([1, 2, 3, 9, 5], [False] * 5), node([7], [True])
    # branch 1: prompt, turn 1, env reply, turn 2;  branch 2 shares prompt and turn 1, then forks
    segments = to_segments(0, [branch(prompt, turn1, env_a, turn2a), branch(prompt, turn1, rerender, turn2b)])
    assert [s.completion_mask for s in segments] == [[1, 1, 0, 1], [1]]
    assert segments[1].prompt_ids == [1, 2, 3, 4, 1, 2, 3, 9, 5]  # turn 1 is context here, not trained twice
    assert sum(sum(s.completion_mask) for s in segments) == 4
