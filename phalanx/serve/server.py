"""The serving process: the HTTP server (uvicorn) on the main thread, the engine on its own.

uvicorn answers at once (/health says 503) while the engine thread loads the model; then
`phalanx: serving NAME on http://HOST:PORT` is printed with the real port. SIGTERM (or Ctrl-C):
stop accepting (new requests get 503, the listening socket closes), let running requests
finish for `--shutdown-grace` seconds, then end those left with an error chunk, and exit 0
(130 after Ctrl-C, as `phalanx train` does). When the ranks of a multi-rank server lose each
other (`launch/rank_loop.py`), every request gets a clear 503, /health says so, and the process exits
1 at once, for the launcher to restart the ranks.
"""

from __future__ import annotations

import signal
import sys
import threading

import uvicorn

from phalanx.errors import UserError
from phalanx.serve.api import ServeState, build_app
from phalanx.serve.engine_loop import EngineLoop
from phalanx.serve.http_limits import uvicorn_limits
from phalanx.serve.job import ServeJob


class PhalanxServer(uvicorn.Server):
    """uvicorn's server with phalanx's start line and signal handling (uvicorn's own would raise
    the signal again after shutting down, and so exit by it instead of 0 or 130)."""

    def __init__(self, config: uvicorn.Config, on_listening, on_signal):
        super().__init__(config)
        self.on_listening, self.on_signal = on_listening, on_signal
        self.stop_signal: int | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            self.on_listening(self.servers[0].sockets[0].getsockname()[1])

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: do not wait any longer
            self.force_exit = True
            return
        self.stop_signal = sig
        self.should_exit = True
        self.on_signal(sig)


def serve(job: ServeJob, build_engine, codec, chat_template, metrics, max_len: int, vocab_size: int,
          sampling_defaults: dict | None = None) -> int:
    """Run until a signal; `build_engine()` runs on the engine thread and returns the Engine.
    `sampling_defaults`: the checkpoint's, for the fields a request leaves out."""
    failure: list[BaseException] = []
    server: PhalanxServer | None = None

    def load_failed(error: BaseException) -> None:
        failure.append(error)
        message = str(error) if isinstance(error, UserError) else f"loading the model failed: {error!r}"
        print(f"phalanx: error: {message}", file=sys.stderr, flush=True)
        if server is not None:
            server.should_exit = True

    def fatal(why: str) -> None:
        failure.append(RuntimeError(why))
        print(f"phalanx: error: {why}", file=sys.stderr, flush=True)
        if server is not None:
            server.should_exit = True

    # The serving line once both the port is open and the model is in: a supervisor that waits
    # for it never sees success from a server whose load then fails.
    shown: dict[str, object] = {}
    announce_lock = threading.Lock()

    def announce(**news) -> None:
        with announce_lock:
            shown.update(news)
            if "port" in shown and "loaded" in shown and not shown.get("said"):
                shown["said"] = True
                print(f"phalanx: serving {job.served_model_name} on http://{shown_host}:{shown['port']}", flush=True)

    def build_then_announce():
        built = build_engine()
        announce(loaded=True)
        return built

    engine = EngineLoop(build_then_announce, job.max_waiting, metrics, load_failed, fatal)
    state = ServeState(job.served_model_name, engine, codec, chat_template, metrics, max_len, vocab_size,
                       job.api_key, sampling_defaults or {}, job.max_request_bytes)
    grace = job.shutdown_grace
    host = job.host
    shown_host = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(build_app(state), host=job.host, port=job.port, log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=grace + 5, **uvicorn_limits())

    def listening(port: int) -> None:
        announce(port=port)

    timer: list[threading.Timer] = []

    def stopping(sig: int) -> None:
        engine.accepting = False
        timer.append(threading.Timer(grace, engine.end_all, ("the server shut down before this request finished",)))
        timer[0].daemon = True
        timer[0].start()

    server = PhalanxServer(config, listening, stopping)
    engine.start()
    try:
        server.run()
    finally:
        for pending in timer:
            pending.cancel()
        engine.stop()
    if failure:
        return 2 if isinstance(failure[0], UserError) else 1
    return 130 if server.stop_signal == signal.SIGINT else 0
