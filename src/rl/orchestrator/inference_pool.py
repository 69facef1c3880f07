"""The orchestrator's view of the inference servers: health, and moving all of them to new weights."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from rl import health
from rl.orchestrator.engine_metrics import Scrape, scrape_of


CHECK_TIMEOUT_S = 10.0  # a server's /policy_step; its first after a start hashes the base model once
METRICS_TIMEOUT_S = 5.0  # a whole /metrics read: a server that drips its reply holds no step longer
MAX_METRICS_BYTES = 4 << 20  # vLLM's exposition is some hundred KB; a longer reply is not read on


class InferenceError(RuntimeError):
    """An inference server failed or did not answer in time."""


class InferencePool:
    def __init__(self, base_urls: list[str], admin_token: str | None, timeout_s: float,
                 log: Callable[[str], None] = lambda message: None):
        self.base_urls = [u.rstrip("/") for u in base_urls]
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout_s)
        self.log = log
        self.metrics_trouble: dict[str, str] = {}  # url: why its /metrics were not read (logged when it changes)

    async def close(self) -> None:
        await self.http.aclose()

    async def wait_healthy(self, timeout_s: float) -> None:
        """Until every server answers /health; InferenceError naming the ones that never did."""
        try:
            await health.wait_healthy(self.http, self.base_urls, timeout_s)
        except TimeoutError as e:
            raise InferenceError(str(e)) from None

    async def update_weights(self, step: int, path: str, servers: list[int] | None = None) -> list[dict]:
        """Move every server (or those at the indices `servers`) to weights/step_{step}; return what each reports it
        now serves."""
        urls = self.base_urls if servers is None else [self.base_urls[i] for i in servers]
        return await asyncio.gather(*(self._update(u, step, path) for u in urls))

    async def current(self) -> list[dict | str]:
        """What each server serves (its /policy_step: step, checksum, instance), or why it did not answer."""
        return await asyncio.gather(*(self._current(url) for url in self.base_urls))

    async def _current(self, url: str) -> dict | str:
        try:
            response = await self.http.get(f"{url}/policy_step", timeout=CHECK_TIMEOUT_S)
        except httpx.HTTPError as e:
            return f"{url} did not answer /policy_step: {e!r}"
        if response.status_code != 200:
            return f"{url} answered /policy_step with {response.status_code} {response.text[:500]}"
        return response.json()

    async def metrics(self) -> list[Scrape | None]:
        """Each server's figures from its Prometheus /metrics (engine_metrics.py), parsed off the event loop; None
        where it holds none, or did not answer whole within METRICS_TIMEOUT_S and MAX_METRICS_BYTES (named in the
        log): the step goes on without them."""
        texts = await asyncio.gather(*(self._metrics(url) for url in self.base_urls))
        return await asyncio.to_thread(lambda: [None if text is None else scrape_of(text) for text in texts])

    async def _metrics(self, url: str) -> str | None:
        try:
            text, trouble = await asyncio.wait_for(self._read_metrics(url), METRICS_TIMEOUT_S)
        except (httpx.HTTPError, TimeoutError) as e:
            text, trouble = None, (f"did not answer whole within {METRICS_TIMEOUT_S:g} s" if isinstance(e, TimeoutError)
                                   else f"did not answer ({type(e).__name__})")
        if trouble != self.metrics_trouble.get(url):
            self.log(f"{url}/metrics {trouble}: the step records go on without its figures" if trouble
                     else f"{url}/metrics answers again")
            self.metrics_trouble[url] = trouble
        return text

    async def _read_metrics(self, url: str) -> tuple[str | None, str | None]:
        """The /metrics text, or None and why not (a status, a reply too long)."""
        async with self.http.stream("GET", f"{url}/metrics", timeout=METRICS_TIMEOUT_S) as response:
            if response.status_code != 200:
                return None, None  # the gate's 404 where metrics are off: nothing to say
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    return None, f"replied more than {MAX_METRICS_BYTES >> 20} MiB"
        return body.decode(errors="replace"), None

    async def receive_weights(self, step: int, host: str, port: int, timeout_s: float,
                              servers: list[int]) -> list[dict | str]:
        """Ask the servers at the indices `servers` to receive step `step` over the wire, each at its rank (the
        trainer is rank 0), at once: they form the step's group together. Per server: what it now serves, or why it
        refused or failed: it then serves what it verified last, or, where it did not answer (it stopped or restarted
        mid-transfer), whatever it serves now, which the orchestrator asks it next."""
        spec = {"host": host, "port": port, "world_size": len(servers) + 1, "timeout_s": timeout_s}
        return await asyncio.gather(*(self._receive(self.base_urls[i], step, spec | {"rank": rank})
                                      for rank, i in enumerate(servers, start=1)))

    async def _receive(self, url: str, step: int, spec: dict) -> dict | str:
        try:  # the group's forming and every tensor have deadlines of timeout_s; the whole step gets a generous one
            response = await self.http.post(f"{url}/update_weights", json={"step": step, "transfer": spec},
                                             timeout=self.http.timeout.read + 4 * spec["timeout_s"])
        except httpx.HTTPError as e:  # it left mid-transfer: the step fails by its deadlines, and the run goes on
            return f"{url} did not answer /update_weights for step {step} (over the wire): {e!r}"
        if response.status_code != 200:
            return f"{url} did not take step {step}: {response.status_code} {response.text[:500]}"
        served = response.json()
        if served.get("step") != step:
            return f"{url} was sent step {step} but reports it serves {served}"
        return served

    async def _update(self, url: str, step: int, path: str) -> dict:
        try:
            response = await self.http.post(f"{url}/update_weights", json={"step": step, "path": path})
        except httpx.HTTPError as e:
            raise InferenceError(f"{url} did not answer /update_weights for step {step}: {e!r}") from e
        if response.status_code != 200:
            raise InferenceError(f"{url} refused weights of step {step}: {response.status_code} {response.text}")
        served = response.json()
        if served.get("step") != step:
            raise InferenceError(f"{url} was asked for step {step} but reports it serves {served}")
        return served
