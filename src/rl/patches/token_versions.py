"""verifiers: each sampled node of a trace is stamped, as its turn commits, with the policy version that sampled
each of its tokens (`stamp_policy_versions`)."""

from __future__ import annotations

from collections.abc import Callable

from rl.patches.targets import once, patch_target


@once
def stamp_policy_versions(versions: Callable[[str, list[int], list[bool]], list[float] | None], stream: str) -> None:
    """verifiers' `PendingTurn.commit` appends the turn's sampled node (the generation-prompt scaffold, then the
    completion: `mask` False, then True) and is the one place a trace gets one; it drops which weights sampled the
    completion, which vLLM's reply tells (a request that spans a weight update has tokens of two policies). After
    the commit, `versions(trace id, token_ids, mask)` (rl's `POLICY_VERSIONS.node_versions`, rl/envs/
    policy_versions.py: the spans rl's transport recorded from the reply) gives a version per token, or None
    (unknown); the node's `loss_weights` then holds them as `stream`: verifiers' per-token field left to its
    consumers, serialized with the node, so it crosses the env-server wire with the trace. It is stamped inside
    the commit, before anything can send the node. Applied with the other patches to verifiers
    (`rl.envs.process_setup.apply_patches`)."""
    from verifiers.v1 import graph

    turn = patch_target(graph, "PendingTurn", "verifiers")
    commit = patch_target(turn, "commit", "verifiers")

    def commit_stamped(self, response):
        node_id = commit(self, response)
        node = self.trace.nodes[node_id]
        stamped = versions(self.trace.id, node.token_ids, node.mask) if node.sampled else None
        if stamped is not None:
            node.loss_weights = {**(node.loss_weights or {}), stream: stamped}
        return node_id

    turn.commit = commit_stamped
