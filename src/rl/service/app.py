"""The REST surface of the Tinker SDK (0.38) over rl's trainer and inference servers, under /api/v1.

Every slow operation answers at once with a future (`request_id`) that the SDK long-polls through /retrieve_future:
training calls go to the trainer in each model's seq_id order (rl/service/training.py), samples to vLLM
(rl/service/sampler.py). One trained model per service. What rl does not implement is refused by name: an unknown
route with 404, an unsupported setting with 400, a failed future with its `error` and `category`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rl.atomic import atomic_write_text
from rl.metrics_file import append_metrics
from rl.protocol import RunPaths
from rl.service.config import API_KEY_VAR, ServiceConfig
from rl.service.sampler import Sampler, SampleError
from rl.service.training import TIMES, CallFailed, InOrder, TrainerCalls
from rl.service.wire import WireError, forward_backward_output, read_forward_backward, sample_output

PROTOBUF = "application/x-protobuf"
SESSION_SILENCE_S = 60.0  # the SDK beats every 10 s: six missed beats end a session (its model may be replaced)
ANSWERED_KEEP_S = 120.0  # an answered future stays retrievable this long: the SDK may not have read the answer


class Refused(ValueError):
    """A request refused at once, with its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class TrainedModel:
    model_id: str
    lora_rank: int | None
    order: InOrder
    sampler_paths: dict[str, int] = field(default_factory=dict)  # name: policy step
    submitted: dict[int, str] = field(default_factory=dict)  # seq_id: request_id, of its latest requests


class Service:
    def __init__(self, config: ServiceConfig, trainer: TrainerCalls, sampler: Sampler):
        self.config, self.trainer, self.sampler = config, trainer, sampler
        self.paths = RunPaths(config.output_dir)
        self.model: TrainedModel | None = None
        self.sampling_sessions: dict[str, int] = {}  # id: policy step it samples
        self.futures: dict[str, asyncio.Task] = {}
        self.answered: dict[str, float] = {}  # request_id: when retrieve_future first answered it
        self.sessions: dict[str, float] = {}  # id: its last sign of life (monotonic)
        self.step = 0  # the trained policy's version: optimizer steps taken
        self.name = config.api.served_model_name or config.model  # what clients call the model
        self.names = {self.name, config.model}

    # ---- sessions: a model belongs to one; once it ends (finished, or silent), a new model may replace it ----

    def create_session(self, body: dict) -> dict:
        session = f"rl-{uuid.uuid4().hex[:12]}"
        self.sessions[session] = time.monotonic()
        return {"session_id": session, "type": "create_session"}

    def heartbeat(self, body: dict) -> dict:
        if body.get("session_id") in self.sessions:
            self.sessions[body["session_id"]] = time.monotonic()
        return {"type": "session_heartbeat"}

    def session_alive(self, session: str) -> bool:
        beat = self.sessions.get(session)
        return beat is not None and time.monotonic() - beat < SESSION_SILENCE_S

    # ---- futures ----

    def submit(self, kind: str, work, **reply) -> dict:
        now = time.monotonic()
        for old in [r for r, at in self.answered.items() if now - at > ANSWERED_KEEP_S]:
            del self.answered[old], self.futures[old]
        request_id = f"{kind}-{uuid.uuid4().hex[:12]}"
        self.futures[request_id] = asyncio.create_task(self.timed(kind, work))
        return {"request_id": request_id, **reply}

    async def timed(self, kind: str, work):
        """Each request's line in metrics.jsonl: the policy step after it, its time from arrival to answer
        (`call_s/<kind>`) and the trainer's part of it (`trainer_s/<kind>`; the rest waited for earlier requests or
        for files)."""
        start, times = time.perf_counter(), {"step": self.step}
        TIMES.set(times)  # this task's own: the trainer's calls add to it
        try:
            return await work()
        except CallFailed as e:
            if e.model_lost:  # a restarted trainer holds no model: the client loads a saved state into a new one
                self.model = None
            raise
        finally:
            self.step = times.pop("step")
            timings = {f"{name}/{kind}": value for name, value in times.items()}  # a series per kind of request
            append_metrics(self.paths, {"process": "service", "step": self.step, "call": kind, "time": time.time(),
                                        f"call_s/{kind}": time.perf_counter() - start, **timings})

    async def retrieve(self, request_id: str) -> Response:
        task = self.futures.get(request_id)
        if task is None:
            raise Refused(404, f"no future {request_id!r} (a service restart forgets them)")
        done, _ = await asyncio.wait({task}, timeout=self.config.api.long_poll_s)
        if not done:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        self.answered.setdefault(request_id, time.monotonic())
        error = task.exception()
        if isinstance(error, (CallFailed, SampleError, WireError, Refused)):
            category = getattr(error, "category", "user")
            return JSONResponse({"error": str(error), "category": category})
        if error is not None:
            return JSONResponse({"error": f"{type(error).__name__}: {error}", "category": "server"})
        result = task.result()
        return Response(result, media_type=PROTOBUF) if isinstance(result, bytes) else JSONResponse(result)

    def in_order(self, model: TrainedModel, kind: str, seq_id: int, work) -> dict:
        """A call of `model`, run in seq_id order. The SDK sends a call again, with its seq_id, when it did not read
        the first answer in time: the first one's future answers it, rather than a refusal for an old seq_id."""
        again = model.submitted.get(seq_id)
        if again in self.futures:
            return {"request_id": again}
        reply = self.submit(kind, lambda: model.order.run(seq_id, work))
        model.submitted = {s: r for s, r in model.submitted.items() if s > seq_id - 64} | {seq_id: reply["request_id"]}
        return reply

    # ---- the trained model ----

    def trained(self, model_id: str) -> TrainedModel:
        if self.model is None or self.model.model_id != model_id:
            raise Refused(404, f"no model {model_id!r}: this service trains "
                               f"{self.model.model_id if self.model else 'none yet (create_model first)'}")
        return self.model

    def create_model(self, body: dict) -> dict:
        if body.get("base_model") not in self.names:
            raise Refused(400, f"base_model {body.get('base_model')!r} is not the model this service trains, "
                               f"{self.name!r}")
        if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
            raise Refused(400, f"optimizer {body['optimizer_config']}: rl trains with AdamW only")
        lora = body.get("lora_config")
        if lora and not (lora.get("train_mlp", True) and lora.get("train_attn", True)):
            raise Refused(400, "lora_config with train_mlp or train_attn false: rl adapts both")
        model = self.new_model(body, lora["rank"] if lora else None)

        async def create():
            async with self.made(model):
                await self.trainer.call("create_model", lora_rank=model.lora_rank, seed=(lora or {}).get("seed") or 0)
            return {"model_id": model.model_id, "type": "create_model"}
        return self.submit("create_model", create, model_id=model.model_id)

    @contextlib.asynccontextmanager
    async def made(self, model: TrainedModel):
        """The trainer makes `model`: if it cannot, the service holds no model (the client may create one again)."""
        try:
            yield
        except CallFailed:
            if self.model is model:
                self.model = None
            raise

    def new_model(self, body: dict, lora_rank: int | None) -> TrainedModel:
        if self.model is not None and self.session_alive(self.model.model_id.split(":train:")[0]):
            raise Refused(409, f"this service already trains {self.model.model_id}, whose session is alive; start "
                               "another rl serve-api for a second model, or end that session")
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        self.model = TrainedModel(model_id, lora_rank, InOrder(self.config.api.call_timeout_s))
        return self.model

    def info(self, body: dict) -> dict:
        model = self.trained(body["model_id"])
        return {"model_id": model.model_id, "model_data": {"arch": "rl", "model_name": self.name,
                                                           "tokenizer_id": self.name},
                "is_lora": model.lora_rank is not None, "lora_rank": model.lora_rank,
                "model_name": self.name, "type": "get_info"}

    def forward_backward(self, body: bytes) -> dict:
        request = read_forward_backward(body)
        model = self.trained(request.model_id)
        tensors = {}
        for i, datum in enumerate(request.datums):
            tensors[f"{i}/tokens"] = torch.from_numpy(datum.tokens)
            tensors |= {f"{i}/{name}": torch.from_numpy(array) for name, array in datum.inputs.items()}

        async def run():
            result, outputs = await self.trainer.call(
                "forward_backward", tensors, datums=len(request.datums), loss_fn=request.loss_fn,
                loss_fn_config=request.loss_fn_config, forward_only=request.forward_only)
            logprobs = [outputs[f"logprobs/{i}"].numpy() for i in range(len(request.datums))]
            return forward_backward_output(logprobs, result["metrics"])
        kind = "forward" if request.forward_only else "forward_backward"
        return self.in_order(model, kind, request.seq_id, run)

    def optim_step(self, body: dict) -> dict:
        model = self.trained(body["model_id"])
        if "adam_params" not in body:
            raise Refused(400, f"optimizer_params {body.get('optimizer_params')}: rl trains with AdamW (adam_params)")
        adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                "grad_clip_norm": 0.0} | body["adam_params"]

        async def step():
            result, _ = await self.trainer.call("optim_step", adam_params=adam)
            return {"metrics": result["metrics"], "type": "optim_step"}
        return self.in_order(model, "optim_step", body["seq_id"], step)

    def save_for_sampler(self, body: dict) -> dict:
        model = self.trained(body["model_id"])
        name = body.get("path")

        async def save():
            result, _ = await self.trainer.call("save_for_sampler")
            if name is None:  # save_weights_and_get_sampling_client: a session of its own
                return {"sampling_session_id": self.new_sampling_session(result["step"]),
                        "type": "save_weights_for_sampler"}
            model.sampler_paths[name] = result["step"]
            return {"path": f"tinker://{model.model_id}/sampler_weights/{name}", "type": "save_weights_for_sampler"}
        return self.in_order(model, "save_weights_for_sampler", body["seq_id"], save)

    def save_state(self, body: dict) -> dict:
        model = self.trained(body["model_id"])
        name = body["path"]

        async def save():
            result, _ = await self.trainer.call("save_state")
            self.write_state(model, name, result["step"])
            return {"path": f"tinker://{model.model_id}/weights/{name}", "type": "save_weights"}
        return self.in_order(model, "save_weights", body["seq_id"], save)

    def load_state(self, body: dict) -> dict:
        """Into the trained model (`model_id`), or into a new one (`session_id`: create_training_client_from_state)
        of the saved state's LoRA rank."""
        path = body["path"]
        model_id, kind, name = parse_path(path)
        state = self.read_states().get(model_id, {}).get(name)
        if kind != "weights" or state is None:
            raise Refused(404, f"no saved state at {path}: save_state makes them (tinker://<model>/weights/<name>)")
        load = {"step": state["step"], "optimizer": body.get("optimizer", True)}
        if "model_id" in body:
            model = self.trained(body["model_id"])

            async def into_model():
                await self.trainer.call("load_state", **load)
                return {"path": path, "type": "load_weights"}
            return self.in_order(model, "load_weights", body["seq_id"], into_model)
        model = self.new_model(body, state["lora_rank"])

        async def into_new_model():
            async with self.made(model):
                await self.trainer.call("create_model", lora_rank=model.lora_rank, seed=0)
                await self.trainer.call("load_state", **load)
            return {"path": path, "model_id": model.model_id, "type": "load_weights"}
        return self.submit("load_weights", into_new_model, model_id=model.model_id)

    def write_state(self, model: TrainedModel, name: str, step: int) -> None:
        """states.json: every saved state by model and name, with what a new model loading it needs; kept in the
        run directory, beside the checkpoints it names."""
        states = self.read_states()
        states.setdefault(model.model_id, {})[name] = {"step": step, "lora_rank": model.lora_rank}
        (self.paths.root / "service").mkdir(exist_ok=True)
        atomic_write_text(self.paths.root / "service" / "states.json", json.dumps(states))

    def read_states(self) -> dict[str, dict[str, dict]]:
        where = self.paths.root / "service" / "states.json"
        return json.loads(where.read_text()) if where.is_file() else {}

    # ---- sampling ----

    def new_sampling_session(self, step: int) -> str:
        session = f"sampler-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[session] = step
        return session

    def create_sampling_session(self, body: dict) -> dict:
        if path := body.get("model_path"):
            model_id, kind, name = parse_path(path)
            if kind != "sampler_weights" or self.model is None or name not in self.model.sampler_paths:
                raise Refused(404, f"no sampler weights at {path}: save_weights_for_sampler makes them")
            step = self.model.sampler_paths[name]
        elif body.get("base_model") in self.names:
            step = 0
        else:
            raise Refused(400, f"base_model {body.get('base_model')!r} is not this service's {self.name!r}")
        return {"sampling_session_id": self.new_sampling_session(step), "type": "create_sampling_session"}

    def asample(self, body: dict) -> dict:
        session = body.get("sampling_session_id")
        if session not in self.sampling_sessions:
            raise Refused(404, f"no sampling session {session!r}")
        step = self.sampling_sessions[session]
        ids = [f"{session}-{body.get('seq_id', 0)}-{i}" for i in range(body.get("num_samples", 1))]

        async def sample():
            sequences, prompt_logprobs, _ = await self.sampler.sample(step, body)
            return sample_output(sequences, prompt_logprobs)
        return self.submit("sample", sample, sample_sequence_ids=ids)


def parse_path(path: str) -> tuple[str, str, str]:
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3:
        raise Refused(400, f"{path!r} is not a tinker://<model_id>/<kind>/<name> path")
    return parts[0], parts[1], parts[2]


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="rl serve-api")
    key = os.environ.get(API_KEY_VAR, "")

    @app.middleware("http")
    async def checked(request: Request, call_next):
        given = request.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.encode(), key.encode()):
            return JSONResponse({"detail": f"X-API-Key is not this service's {API_KEY_VAR}"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(Refused)
    async def refused(request: Request, e: Refused):
        return JSONResponse({"detail": str(e)}, status_code=e.status)

    for kind in (WireError, SampleError, KeyError):  # a body rl cannot read: never a 400 without a body
        app.add_exception_handler(kind, lambda request, e: JSONResponse({"detail": f"{type(e).__name__}: {e}"},
                                                                        status_code=400))

    json_routes = {
        "create_model": service.create_model, "get_info": service.info, "optim_step": service.optim_step,
        "save_weights_for_sampler": service.save_for_sampler, "save_weights": service.save_state,
        "load_weights": service.load_state, "create_sampling_session": service.create_sampling_session,
        "asample": service.asample,
        "client/config": lambda body: {"use_pyqwest_transport": False},
        "client/dynamic_config": lambda body: {},
        "create_session": service.create_session,
        "session_heartbeat": service.heartbeat,
        "telemetry": lambda body: {"status": "accepted"},
    }

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        return service.forward_backward(await request.body())

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        return await service.retrieve((await request.json())["request_id"])

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": service.name, "trainable": True, "sampleable": True,
                                      "max_context_length": service.config.seq_len}]}

    @app.get("/api/v1/samplers/{session}")
    async def sampler(session: str):
        if session not in service.sampling_sessions:
            raise Refused(404, f"no sampling session {session!r}")
        return {"sampler_id": session, "base_model": service.name}

    @app.post("/api/v1/sessions/{session}/finish")
    async def finish(session: str):
        service.sessions.pop(session, None)
        return {}

    @app.api_route("/api/v1/{route:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def route(route: str, request: Request):
        handler = json_routes.get(route) if request.method == "POST" else None
        if handler is None:
            raise Refused(404, f"rl serve-api does not implement {request.method} /api/v1/{route} "
                               "(docs/tinker.md lists what it does)")
        return handler(await request.json())

    return app
