"""The orchestrator's view of the inference servers: health, and moving all of them to new weights."""

from __future__ import annotations

import asyncio

import httpx

from rl import health


class InferenceError(RuntimeError):
    """An inference server failed or did not answer in time."""


class InferencePool:
    def __init__(self, base_urls: list[str], admin_token: str | None, timeout_s: float):
        self.base_urls = [u.rstrip("/") for u in base_urls]
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout_s)

    async def close(self) -> None:
        await self.http.aclose()

    async def wait_healthy(self, timeout_s: float) -> None:
        """Until every server answers /health; InferenceError naming the ones that never did."""
        try:
            await health.wait_healthy(self.http, self.base_urls, timeout_s)
        except TimeoutError as e:
            raise InferenceError(str(e)) from None

    async def update_weights(self, step: int, path: str) -> list[dict]:
        """Move every server to weights/step_{step}; return what each reports it now serves."""
        return await asyncio.gather(*(self._update(u, step, path) for u in self.base_urls))

    async def receive_weights(self, step: int, host: str, port: int, timeout_s: float) -> list[dict | str]:
        """Ask every server to receive step `step` over the wire, each at its rank (the trainer is rank 0), at once:
        they form the step's group together. Per server: what it now serves, or why it refused or failed (it then
        still serves what it verified last). InferenceError if a server cannot be reached at all."""
        world_size = len(self.base_urls) + 1
        spec = {"host": host, "port": port, "world_size": world_size, "timeout_s": timeout_s}
        return await asyncio.gather(*(self._receive(url, step, spec | {"rank": rank})
                                      for rank, url in enumerate(self.base_urls, start=1)))

    async def _receive(self, url: str, step: int, spec: dict) -> dict | str:
        try:  # the group's forming and every tensor have deadlines of timeout_s; the whole step gets a generous one
            response = await self.http.post(f"{url}/update_weights", json={"step": step, "transfer": spec},
                                             timeout=self.http.timeout.read + 4 * spec["timeout_s"])
        except httpx.HTTPError as e:
            raise InferenceError(f"{url} did not answer /update_weights for step {step} (over the wire): {e!r}") from e
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
