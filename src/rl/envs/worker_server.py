"""The server each of rl's env-server workers runs: verifiers' `EnvServer`, subclassed, and installed as the class
verifiers' pool builds in each worker (rl/patches: `serve_env_with`, applied by rl's env server in its broker, whose
forked workers inherit it). Ordinary overrides, each calling verifiers' own:

    run        holds the chat calls' shared HTTP session and the worker's heartbeat while it serves, tunes the GC
               once the environment is loaded (as the orchestrator did around the environments it ran), and drops
               frames verifiers would fail on outside its handler (a request id it cannot decode ended the worker)
    _handle    answers rl's `run_group` (a group's episodes in one request, rl/envs/groups.py) beside verifiers'
               routes, which it leaves to verifiers
    _context   runs no episode whose client names a variable or endpoint the server does not allow (rl/envs/trust.py);
               a refusal fails the request as data
"""

from __future__ import annotations

import logging

import msgpack
from verifiers.v1.serve import EnvServer

from rl.envs.groups import ROUTE, SERVER_MEMBERS, serve_group
from rl.envs.process_setup import tune_gc_for_serving, worker_holds
from rl.envs.trust import ClientPolicy, screen_request
from rl.patches import require_members

logger = logging.getLogger(__name__)


class WorkerServer(EnvServer):
    """verifiers' env server with rl's route, request screen and client policy (`client_policy`: what a request's
    model client may read and call, given by the broker through the pool's server arguments)."""

    def __init__(self, *, client_policy: ClientPolicy, **kwargs) -> None:
        super().__init__(**kwargs)
        self.client_policy = client_policy
        require_members(self, SERVER_MEMBERS, "verifiers")  # what serve_group reads: checked before any request

    async def run(self) -> None:
        self.frontend.recv_multipart = self.screened(self.frontend.recv_multipart)  # the one receive run() calls
        async with worker_holds():
            tune_gc_for_serving()
            await super().run()

    def screened(self, receive):
        """`receive`, answering and dropping the frames `screen_request` gives a reason for."""
        async def receive_screened(*args, **kwargs):
            while True:
                frames = await receive(*args, **kwargs)
                why = screen_request(frames)
                if why is None:
                    return frames
                logger.warning("request dropped: %s", why)
                refusal = msgpack.packb({"success": False, "error": why}, use_bin_type=True)
                await self.frontend.send_multipart([frames[0], frames[1], b"reply", refusal])
        return receive_screened

    async def _handle(self, client_id: bytes, request_id: bytes, method: bytes, payload: bytes) -> None:
        if method == ROUTE:
            return await serve_group(self, client_id, request_id, payload)
        return await super()._handle(client_id, request_id, method, payload)

    def _context(self, client_config, model, sampling):
        self.client_policy.check(client_config, model)
        return super()._context(client_config, model, sampling)
