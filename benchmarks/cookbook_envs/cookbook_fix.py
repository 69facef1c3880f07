"""tinker-cookbook 0.5.5 to 0.6.1: the `verifiers_rl` recipe replaces `rollouts.do_group_rollout` with a function that
takes no `termination`, which the cookbook's own rollout code passes, so the recipe fails with a TypeError whatever
serves it. benchmarks/tinker_cookbook.py imports this module first (`python -c`): a replacement set on the rollouts
module is wrapped to take what it accepts. Nothing else of the recipe changes."""

import inspect
import types

import tinker_cookbook.rl.rollouts as rollouts


class Rollouts(types.ModuleType):
    def __setattr__(self, name, value):
        if name == "do_group_rollout" and "termination" not in inspect.signature(value).parameters:
            replacement = value

            async def value(builder, policy, strategy=None, termination=None):  # noqa: ARG001 - dropped
                return await replacement(builder, policy, strategy=strategy)
        super().__setattr__(name, value)


rollouts.__class__ = Rollouts
