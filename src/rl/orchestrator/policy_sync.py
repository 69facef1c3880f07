"""How the servers come to serve the policy each batch needs, chosen once by the run's transport: from the files the
trainer publishes (`FilesSync`) or from the offers it makes over the wire (`OffersSync`)."""

from __future__ import annotations

import asyncio
import time

from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.inference_pool import InferenceError, InferencePool
from rl.orchestrator.servers import ServerBoard
from rl.protocol import RunPaths, stable_steps, wait_for_stable
from rl.weights import TransferError
from rl.weights.offers import offered_steps, read_offer, read_sent, write_take


class PolicySync:
    """What both ways share: the run's servers (`servers`) and the files a resume or a restart loads."""

    def __init__(self, config: OrchestratorConfig, pool: InferencePool, servers: ServerBoard, logger):
        self.config, self.pool, self.servers, self.logger = config, pool, servers, logger
        self.paths = RunPaths(config.output_dir)

    async def start(self, resumed: bool) -> list[dict] | None:
        """Before the first batch: a resumed run's servers load the newest published weights; with LoRA, fresh
        servers get the trainer's step-0 adapter. What the servers now serve (logged with the first batch)."""
        if resumed and stable_steps(self.paths.weights_root):
            return await self.load_newest_policy()
        if self.config.adapter:
            return await self.load_first_adapter()
        return None

    async def ensure(self, step: int, lag: int | None = None) -> list[dict] | None:
        """Batch `step` may only use policies v_j with j >= step - async_level (or `lag`): wait for and load one. A
        server that restarted gets the run's newest policy before any request. What the servers now serve, where that
        changed."""
        raise NotImplementedError

    async def finish(self) -> None:
        """After the last batch."""

    async def load_first_adapter(self) -> list[dict]:
        """With LoRA the servers start with the base model alone; requests name the adapter, so the trainer's
        step-0 adapter (B = 0: the base model's outputs) is served before the first rollout."""
        what = "the trainer's step-0 LoRA adapter (published once the trainer has loaded the model)"
        await asyncio.to_thread(wait_for_stable, self.paths.weights(0), self.config.weights_timeout_s, what)
        served = await self.pool.update_weights(0, str(self.paths.weights(0).absolute()))
        self.logger.info(f"inference now serves adapter {self.config.adapter!r} of policy 0 ({len(served)} servers)")
        return served

    async def load_newest_policy(self) -> list[dict]:
        """Every server that answers loads the newest published weights (none yet: each serves the base model, policy
        0, as a restarted one does)."""
        up = self.servers.up()
        self.servers.caught_up(up)
        newest = max(stable_steps(self.paths.weights_root), default=None)
        if newest is None:
            return None
        served = await self.pool.update_weights(newest, str(self.paths.weights(newest).absolute()), up)
        self.logger.info(f"inference now serves policy {newest} ({len(served)} servers)")
        self.servers.all_serve(up, newest)
        return served



class FilesSync(PolicySync):
    """Each policy from weights/step_k/, which the trainer publishes every step. Step by step, a server loads a
    policy when a batch needs it (async_level behind at most); under continuous dispatch it loads the newest at every
    batch: groups are admitted by the policy served, and servers left on an old one would have every group in flight
    age out together."""

    async def ensure(self, step: int, lag: int | None = None) -> list[dict] | None:
        lag = self.config.async_level if lag is None else lag
        required = step - lag
        await self.servers.wait_for_one()
        up = self.servers.up()
        served = min((self.servers.served_steps[i] for i in up), default=0)
        newer = self.config.continuous and max(stable_steps(self.paths.weights_root), default=0) > served
        if self.servers.policy_step >= required and not self.servers.stale.intersection(up) and not newer:
            self.servers.use(up)
            return None
        if self.servers.policy_step < required:
            what = f"weights of policy {required} (needed by batch {step} {lag} policies behind at most)"
            await asyncio.to_thread(wait_for_stable, self.paths.weights(required), self.config.weights_timeout_s, what)
        return await self.load_newest_policy()


class OffersSync(PolicySync):
    """Each policy over the wire (rl/weights/): the trainer offers every step and waits until it is taken."""

    def __init__(self, config: OrchestratorConfig, pool: InferencePool, servers: ServerBoard, logger):
        super().__init__(config, pool, servers, logger)
        self.last_offer = 0  # the last step offered over the wire that was taken (or tried)
        self.offers_beyond: set[int] = set()  # offers of steps the trainer cannot have made yet, logged once each

    async def start(self, resumed: bool) -> list[dict] | None:
        if self.config.adapter and not (resumed and stable_steps(self.paths.weights_root)):
            self.last_offer = -1  # the trainer offers its step-0 adapter first
            return await self.take_offers(0, 0, "the first batch (the trainer's step-0 adapter)", defer_newest=False)
        return await super().start(resumed)

    async def ensure(self, step: int, lag: int | None = None) -> list[dict] | None:
        lag = self.config.async_level if lag is None else lag
        await self.servers.wait_for_one()
        return await self.take_offers(step - lag, step, f"batch {step} ({lag} policies behind at most)")

    async def finish(self) -> None:
        """The trainer offers its last steps too, and waits until they are taken."""
        await self.take_offers(self.config.max_steps, self.config.max_steps, "the end of the run")

    async def load_newest_policy(self) -> list[dict]:
        served = await super().load_newest_policy()
        if served is not None:
            self.last_offer = self.servers.policy_step  # offers up to it are the trainer's before its checkpoint
        return served

    async def take_offers(self, required: int, newest: int, needed_by: str,
                          defer_newest: bool = True) -> list[dict] | None:
        """Over the wire the trainer waits on every step it offers until it is taken, so every offer is taken, in
        order, at a batch boundary; while no server serves `required` or newer, wait for the next offer, up to
        policy `newest` (the last the trainer can offer before this point). The offer of `newest` waits for the next
        boundary while a server serves `required` (unless `defer_newest` is False: the step-0 adapter, which the first
        batch must be made with): were its transfer to fail everywhere (a server killed mid-receive), no later offer
        could come before this batch, which the trainer needs to make one. Servers left behind (their
        transfer failed, or they restarted) get no requests until an offer brings them up to date. No offer is taken
        while no server answers: it would reach nobody."""
        served = None
        deadline = time.monotonic() + self.config.weights_timeout_s
        while True:
            pending = [k for k in self.offered_up_to(newest) if k > self.last_offer]
            deferred = defer_newest and pending[:1] == [newest] and bool(self.servers.serving(required))
            if pending and not deferred:
                await self.servers.check()
                await self.servers.wait_for_one()
                served = await self.take(pending[0]) or served
                continue
            if self.servers.use_those_serving(required):
                return served
            if self.last_offer >= newest and (served := await self.catch_up_from_files(required)):
                continue  # no offer will come before this batch: a checkpoint's files brought servers up to date
            if self.last_offer >= newest:  # the last offer possible failed everywhere, and the next needs this batch
                raise InferenceError(f"{needed_by} needs policy {required}, but no server serves it (they serve "
                                     f"policies {self.servers.served_steps}; -1: not answering; servers "
                                     f"{sorted(self.servers.refused)} serve weights the trainer did not send): its "
                                     "transfer failed or the servers restarted since, and no checkpoint's files hold "
                                     "it (see the warnings above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.config.weights_timeout_s:.0f} s for the trainer's offer of policy "
                                   f"{required} (needed by {needed_by})")
            await asyncio.sleep(0.02)

    def offered_up_to(self, newest: int) -> list[int]:
        """The steps offered, up to `newest`: the trainer waits on each offer until it is taken, so it cannot have
        offered a later one; a file that says so is not the trainer's, and taking it would skip every real offer
        before its step."""
        offered = offered_steps(self.config.output_dir)
        for step in sorted(set(k for k in offered if k > newest) - self.offers_beyond):
            self.logger.warning(f"offer of policy {step} not taken: the trainer cannot have offered a policy after "
                                f"{newest} yet")
            self.offers_beyond.add(step)
        return [k for k in offered if k <= newest]

    async def take(self, step: int) -> list[dict] | None:
        """Take the trainer's offer of `step`: every server receives it at once; one that refuses or fails keeps the
        weights it verified last (the next offer brings it up to date), one that serves other weights than the
        trainer sent gets no requests until it serves a step the trainer sent. An offer that is not as the trainer
        writes them is not taken (read off the event loop: it may be anything)."""
        try:
            offer = await asyncio.to_thread(read_offer, self.config.output_dir, step, self.config.transfer.host)
        except TransferError as e:
            self.logger.warning(f"offer of policy {step} not taken: {e}")
            self.last_offer = step
            return None
        if offer is None:
            raise InferenceError(f"the trainer's offer of policy {step} disappeared before it was taken")
        self.last_offer = step
        up = self.servers.up()
        write_take(self.config.output_dir, step, len(up))
        results = await self.pool.receive_weights(step, offer.host, offer.port, self.config.transfer.timeout_s, up)
        results = await self.held_to_the_trainers_checksum(step, up, results)
        for i, result in zip(up, results):
            if isinstance(result, str):
                self.logger.warning(f"policy {step} did not reach server {i}: {result}")
            else:
                self.servers.serve([i], result["step"])
        taken = [r for r in results if not isinstance(r, str)]
        if len(taken) < len(results):
            await self.servers.check()  # one that stopped or restarted mid-transfer gets no requests until it is back
        self.logger.info(f"policy {step} went over the wire to {len(taken)} of {len(up)} servers (checksums "
                         f"{[r['weights_checksum'] for r in taken]}); they serve policies {self.servers.served_steps}")
        return taken or None

    async def held_to_the_trainers_checksum(self, step: int, servers: list[int], results: list[dict | str]
                                            ) -> list[dict | str]:
        """A server that reports step `step` with a checksum other than the one the trainer sent (or where the
        trainer sent none) is refused: it serves those weights (a server keeps what it loaded and verified), so it gets
        no requests, even where the batch may use the policy it served before, until a later step the trainer sent
        brings it up to date (`ServerBoard.refuse`); its result is why."""
        if all(isinstance(r, str) for r in results):
            return results
        sent = await asyncio.to_thread(read_sent, self.config.output_dir, step, self.config.transfer.timeout_s)
        held = []
        for i, result in zip(servers, results):
            if not isinstance(result, str) and result.get("weights_checksum") != sent:
                result = (f"it reports it serves checksum {result.get('weights_checksum')}, but the trainer sent "
                          f"{sent or 'no step'}: its policy {step} is refused")
                self.logger.error(f"server {i} serves weights the trainer did not send as policy {step}, and gets no "
                                  f"requests until it serves a step the trainer sent: {result}")
                self.servers.refuse([i], step)
            held.append(result)
        return held

    async def catch_up_from_files(self, required: int) -> list[dict] | None:
        """Over the wire, servers behind `required` load the newest checkpoint's files where they hold it (a server
        restarted after the offer it needed was taken); what they now serve, or None where no files will do."""
        newest = max(stable_steps(self.paths.weights_root), default=-1)
        behind = [i for i in self.servers.up() if self.servers.served_steps[i] < newest]
        if newest < required or not behind:
            return None
        served = await self.pool.update_weights(newest, str(self.paths.weights(newest).absolute()), behind)
        self.servers.serve(behind, newest)
        self.logger.info(f"servers {behind} load policy {newest} from its checkpoint's files (no offer of it is left)")
        return served



SYNCS: dict[str, type[PolicySync]] = {"filesystem": FilesSync, "collective": OffersSync}  # by transfer.type


def policy_sync(config: OrchestratorConfig, pool: InferencePool, servers: ServerBoard, logger) -> PolicySync:
    return SYNCS[config.transfer.type](config, pool, servers, logger)
