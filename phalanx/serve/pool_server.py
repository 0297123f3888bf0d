"""`phalanx serve --pool NAME:PLAN ...`: one endpoint in front of per-class pools of engines.

The front (this process, no model in it) starts every pool's instances (`pool_backend.py`),
routes each request to its class's pool (`pool_router.py`) and relays the answer
(`pool_proxy.py`); a request finds its pool re-sharding is held here until the pool has an
instance again, so none fails. Every quarter second it checks whether ranks should move from an
idle pool to a queued one, and if so moves them: the donor's instance is drained (no new
requests; those running finish), stopped and restarted on fewer ranks, and the receiver takes
the freed ranks. Each move is a line in the log (`phalanx: pool move: ...`) and is counted in
/metrics (`phalanx_pool_moves_total{from,to}`, `phalanx_pool_ranks{pool}`), beside every
instance's own metrics labelled with its pool and instance.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import h11
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from phalanx.serve.api_requests import ApiError
from phalanx.serve.api_responses import DONE, sse
from phalanx.serve.http_limits import ApiKeyCheck, ClientGone, read_body
from phalanx.serve.job import DEFAULT_MAX_REQUEST_BYTES, KEY_ENV
from phalanx.serve.pool_backend import Backend, BackendFailed, backend_command, visible_devices
from phalanx.serve.pool_metrics import merge_metrics
from phalanx.serve.pool_proxy import forward, read_all
from phalanx.serve.pool_router import Instance, Move, Pool, Router, UnknownClass

CHECK_EVERY_S = 0.25
DRAIN_POLL_S = 0.05
DEFAULT_INSTANCE_RESTARTS = 3
"""Times the front starts an instance again after its process died (--max-restarts overrides)."""


def log(message: str) -> None:
    print(f"phalanx: {message}", file=sys.stderr, flush=True)


class PoolFront:
    def __init__(self, router: Router, flags: list[str], device: str, api_key: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, restarts: int = DEFAULT_INSTANCE_RESTARTS):
        self.router, self.flags, self.device = router, flags, device
        self.restarts = restarts
        self.restarted: dict[int, int] = {}  # instance ident -> restarts so far
        self.api_key = api_key
        self.key_env = {} if api_key is None else {KEY_ENV: api_key}
        self.max_request_bytes = max_request_bytes
        self.backends: dict[int, Backend] = {}  # by instance ident
        self.changed = asyncio.Condition()
        self.accepting = True
        self.failed: str | None = None
        self.registry = registry = CollectorRegistry()
        self.moves = Counter("phalanx_pool_moves", "Rank moves between pools (drain, re-shard, resume)",
                             ["from", "to"], registry=registry)
        self.ranks = Gauge("phalanx_pool_ranks", "Ranks each pool holds", ["pool"], registry=registry)
        self.instances = Gauge("phalanx_pool_instances", "Engine instances each pool runs", ["pool"], registry=registry)
        self.routed = Counter("phalanx_pool_requests", "Requests routed to each pool", ["pool"], registry=registry)
        self.held = Gauge("phalanx_pool_requests_held", "Requests waiting in the router for a pool's instance",
                          ["pool"], registry=registry)
        self._show_layout()

    def _show_layout(self) -> None:
        for pool in self.router.pools.values():
            self.ranks.labels(pool=pool.name).set(pool.ranks)
            self.instances.labels(pool=pool.name).set(len(pool.instances))
            self.held.labels(pool=pool.name).set(pool.held)

    def layout(self) -> str:
        return "; ".join(f"{p.name}: " + " + ".join(f"{i.plan} (ranks {','.join(map(str, i.ranks))})"
                                                      for i in p.instances) for p in self.router.pools.values())

    async def start_instance(self, pool: Pool, instance: Instance) -> None:
        label = f"pool {pool.name} instance {instance.ident} {instance.plan}"
        backend = Backend(label, backend_command(self.flags, instance.plan, len(instance.ranks)),
                          {**visible_devices(instance.ranks, self.device), **self.key_env})
        self.backends[instance.ident] = backend
        instance.address = await backend.start()
        async with self.changed:
            instance.ready, instance.failed = True, None
            self.changed.notify_all()
        asyncio.get_running_loop().create_task(self._watch_instance(pool, instance, backend))

    async def _watch_instance(self, pool: Pool, instance: Instance, backend: Backend) -> None:
        """An instance whose process dies (not stopped by the front) is marked failed at once:
        its class gets 503 with why, /health says 503, and it is started again on the same
        ranks while restarts are left."""
        how = await backend.exited()
        if backend.stopping or not self.accepting or self.backends.get(instance.ident) is not backend:
            return
        async with self.changed:
            instance.ready = False
            instance.failed = f"pool {pool.name}'s instance {instance.ident} ({instance.plan}) {how}"
            self.changed.notify_all()
        done = self.restarted.get(instance.ident, 0)
        if done >= self.restarts:
            log(f"error: {instance.failed}; not restarted (--max-restarts {self.restarts})")
            async with self.changed:
                pool.instances.remove(instance)
                self.failed = instance.failed
                self.changed.notify_all()
            return
        self.restarted[instance.ident] = done + 1
        log(f"{instance.failed}; restarting it (restart {done + 1} of {self.restarts})")
        try:
            await self.start_instance(pool, instance)
            log(f"pool {pool.name}'s instance {instance.ident} serves again")
        except BackendFailed as error:
            log(f"error: {error}")
            async with self.changed:
                if instance in pool.instances:
                    pool.instances.remove(instance)
                self.failed = str(error)
                self.changed.notify_all()

    async def start_all(self) -> None:
        await asyncio.gather(*(self.start_instance(pool, instance) for pool in self.router.pools.values()
                               for instance in list(pool.instances)))

    # Requests

    async def acquire(self, pool: Pool, arrived: float) -> Instance:
        """The instance to send a request to: held here while the pool has none open."""
        async with self.changed:
            pool.held_arrivals.append(arrived)
            self._show_layout()
            try:
                while (instance := self.router.pick(pool)) is None:
                    if not self.accepting:
                        raise ApiError(503, "the server is shutting down", code="not_ready")
                    restarting = [i.failed for i in pool.instances if i.failed]
                    if restarting and not self.router.moving:
                        raise ApiError(503, f"{restarting[0]}; the front is restarting it: retry shortly",
                                       code="engine_restarting", kind="server_error")
                    if not pool.instances and not self.router.moving:
                        raise ApiError(503, f"pool {pool.name} has no engine: {self.failed}", code="engine_failed",
                                       kind="server_error")
                    await self.changed.wait()
            finally:
                pool.held_arrivals.remove(arrived)
                self._show_layout()
            instance.arrivals.append(arrived)
            pool.routed += 1
            self.routed.labels(pool=pool.name).inc()
            return instance

    async def release(self, instance: Instance, arrived: float) -> None:
        async with self.changed:
            instance.arrivals.remove(arrived)
            self.changed.notify_all()

    async def generate(self, request: Request) -> Response:
        arrived = time.monotonic()  # the router's clock (watch)
        try:
            body = await read_body(request, self.max_request_bytes)
        except ApiError as error:
            return JSONResponse(error.body(), status_code=error.status)
        except ClientGone:
            return Response(status_code=499)
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            parsed = None  # the engine answers 400 for it
        tier = parsed.get("service_tier") if isinstance(parsed, dict) else None
        try:
            pool = self.router.classify(request.headers.get("x-phalanx-class"), tier)
            instance = await self.acquire(pool, arrived)
        except UnknownClass as error:
            return JSONResponse(ApiError(400, str(error), "service_tier", "unknown_class").body(), status_code=400)
        except ApiError as error:
            return JSONResponse(error.body(), status_code=error.status)
        try:
            answer = await forward(instance.address, "POST", request.url.path, list(request.headers.items()), body)
        except (OSError, h11.ProtocolError) as error:  # the instance died, or is dying
            await self.release(instance, arrived)
            message = f"pool {pool.name}'s engine did not answer: {error}"
            return JSONResponse(ApiError(503, message, code="engine_failed", kind="server_error").body(), status_code=503)
        headers = {name: value for name, value in answer.headers if name.lower() != "content-type"}
        kind = dict((n.lower(), v) for n, v in answer.headers).get("content-type", "application/json")
        if kind.startswith("text/event-stream"):
            async def relay():
                try:
                    async for piece in answer.body:
                        yield piece
                except (OSError, h11.ProtocolError) as error:  # the instance died mid-stream
                    message = f"pool {pool.name}'s engine stopped answering mid-stream: {error}"
                    yield sse(ApiError(503, message, code="engine_failed", kind="server_error").body()).encode()
                    yield DONE.encode()
                finally:
                    await answer.body.aclose()
                    await self.release(instance, arrived)
            return StreamingResponse(relay(), status_code=answer.status, headers=headers, media_type=kind)
        try:
            content = await read_all(answer)
        except (OSError, h11.ProtocolError) as error:
            message = f"pool {pool.name}'s engine stopped answering: {error}"
            return JSONResponse(ApiError(503, message, code="engine_failed", kind="server_error").body(), status_code=503)
        finally:
            await self.release(instance, arrived)
        if answer.status == 429 and b"ttft_target_unattainable" in content:
            self.router.note_refused(pool, time.monotonic())  # queued past its target (pool_router.py)
        return Response(content, status_code=answer.status, headers=headers, media_type=kind)

    async def any_instance_get(self, path: str, headers: list[tuple[str, str]]) -> Response:
        for pool in self.router.pools.values():
            for instance in pool.instances:
                if instance.ready and instance.address:
                    try:
                        answer = await forward(instance.address, "GET", path, headers)
                        return Response(await read_all(answer), status_code=answer.status,
                                        media_type="application/json")
                    except (OSError, h11.ProtocolError):
                        continue  # dying: its watcher marks it; another may answer
        return JSONResponse({"status": "loading"}, status_code=503)

    async def metrics_text(self) -> bytes:
        texts = []
        for pool in self.router.pools.values():
            for instance in pool.instances:
                if instance.ready and instance.ident in self.backends:
                    try:
                        texts.append(({"pool": pool.name, "instance": str(instance.ident)},
                                      await self.backends[instance.ident].metrics()))
                    except (OSError, h11.ProtocolError):
                        continue  # stopping for a move, or dead (its watcher restarts it)
        return generate_latest(self.registry) + merge_metrics(texts).encode()

    # Moves

    async def watch(self) -> None:
        """Every CHECK_EVERY_S: note the pools' loads, and make a move when one is due."""
        while self.accepting:
            now = time.monotonic()
            try:
                self.router.observe(now)
                move = self.router.plan_move(now)
            except Exception as error:  # a bug: say so, keep serving without moves
                log(f"error: the pool watcher failed ({error!r}); ranks no longer move")
                raise
            if move is not None:
                self.router.moving = True
                asyncio.get_running_loop().create_task(self.execute(move))
            await asyncio.sleep(CHECK_EVERY_S)

    async def drain(self, instance: Instance) -> None:
        async with self.changed:
            instance.draining = True
            self.changed.notify_all()
        while instance.in_flight:
            await asyncio.sleep(DRAIN_POLL_S)
        await self.backends.pop(instance.ident).stop()

    async def execute(self, move: Move) -> None:
        began = time.monotonic()
        log(f"pool move: {move.describe()}")
        try:
            await self.drain(move.give)
            move.donor.instances.remove(move.give)
            # Both sides start at once: loading the weights is most of a move's time.
            await asyncio.gather(self._donor_side(move), self._receiver_side(move))
        except BackendFailed as error:
            self.failed = f"a pool move failed: {error}"
            log(self.failed)
            for pool in (move.donor, move.receiver):  # what did not start is gone; the rest serves
                pool.instances = [i for i in pool.instances if i.ready]
        finally:
            self.router.moving = False
            self.router.moves += 1
            for pool in (move.donor, move.receiver):  # a fresh start for the next decision
                pool.idle_since = pool.queued_since = None
            self.moves.labels(**{"from": move.donor.name, "to": move.receiver.name}).inc()
            self._show_layout()
            async with self.changed:
                self.changed.notify_all()
        log(f"pool move done in {time.monotonic() - began:.1f} s: {self.layout()}")

    async def _donor_side(self, move: Move) -> None:
        if move.donor_keeps:
            instance = self.router.new_instance(f"tp={len(move.donor_keeps)}", move.donor_keeps)
            move.donor.instances.append(instance)
            await self.start_instance(move.donor, instance)

    async def _receiver_side(self, move: Move) -> None:
        ranks = move.freed
        if move.grow is not None:
            await self.drain(move.grow)
            move.receiver.instances.remove(move.grow)
            ranks = move.grow.ranks + move.freed
        instance = self.router.new_instance(move.receiver_plan, tuple(sorted(ranks)))
        move.receiver.instances.append(instance)
        await self.start_instance(move.receiver, instance)

    async def stop_all(self) -> None:
        self.accepting = False
        async with self.changed:
            self.changed.notify_all()
        await asyncio.gather(*(backend.stop() for backend in list(self.backends.values())))


def build_front_app(front: PoolFront) -> Starlette:
    async def generate(request: Request) -> Response:
        return await front.generate(request)

    async def models(request: Request) -> Response:
        return await front.any_instance_get("/v1/models", list(request.headers.items()))

    async def health(request: Request) -> Response:
        if not front.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        failed = [i.failed for p in front.router.pools.values() for i in p.instances if i.failed]
        if failed:  # a class is answered 503 until its instance is back
            return JSONResponse({"status": "failed", "reason": "; ".join(failed)}, status_code=503)
        started = all(any(i.ready for i in p.instances) or front.router.moving for p in front.router.pools.values())
        if not started:
            return JSONResponse({"status": "loading" if not front.failed else "failed", "reason": front.failed},
                                status_code=503)
        return JSONResponse({"status": "ok", "pools": front.layout()})

    async def metrics(request: Request) -> Response:
        return Response(await front.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/responses", generate, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], middleware=[Middleware(ApiKeyCheck, key=front.api_key)])  # also at the front: no unkeyed request waits here
