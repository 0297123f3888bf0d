"""The thread that owns the engine: it loads the model, then runs steps while there is work,
and hands each request's new text to the HTTP handler waiting for it.

HTTP handlers (on the asyncio loop) only `submit` and `abort`; both just queue the change,
which the engine thread applies before its next step, so a new request joins the batch at
the next step and a disconnected client's blocks are freed at the next step. Text is
detokenized here (`detokenize.py`), so that a stop string ends the sequence at once.

Failures: a request whose sampling fails (`step_sampler.TokenEvent.error`) fails alone. A step that
raises in one process fails the sequences of that step only, and the server goes on. Over
several ranks a failed step means the ranks are out of step for good (`launch/rank_loop.py`, its `GroupHealth`): every
request fails with a clear 503, `failed` says why (/health answers 503), and `on_fatal` tells
the server to exit non-zero so that the launcher restarts the ranks.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from phalanx.serve.detokenize import IncrementalText
from phalanx.launch.rank_loop import GroupHealth, first_line
from phalanx.scheduling.scheduler import QueueFull, Scheduler, Sequence
from phalanx.scheduling.slo_policy import QueueShape
from phalanx.threads import name_this_thread

IDLE_WAIT_S = 0.5


class NotAccepting(Exception):
    """The model is still loading, or the server is shutting down (503)."""


@dataclass
class Piece:
    text: str
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    status: int = 503
    """With `error`: the HTTP status of the answer (503: the server's state; 500: this request)."""
    code: str = "aborted"
    prompt_logprobs: list | None = None
    """With a choice's first token, when asked: its prompt tokens' scores (prompt_logprobs.PromptScore)."""
    cached_tokens: int = 0
    """Prompt tokens its sequence took from the prefix cache (usage.prompt_tokens_details)."""


@dataclass(eq=False)
class Handle:
    seq: Sequence
    text: IncrementalText
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False

    def put(self, piece: Piece) -> None:
        """From the engine thread: into the handler's queue, on its loop."""
        self.mark(piece)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)

    def mark(self, piece: Piece) -> None:
        """From the engine thread, before `piece` is handed over: the last one ends the request."""
        if piece.finish_reason or piece.error:
            self.done = True


def deliver(pieces: list[tuple[Handle, Piece]]) -> None:
    """On the handlers' loop: a step's pieces into their handlers' queues, in order."""
    for handle, piece in pieces:
        handle.queue.put_nowait(piece)


class EngineLoop:
    def __init__(self, build: Callable[[], object], max_waiting: int, metrics,
                 on_load_error: Callable[[BaseException], None], on_fatal: Callable[[str], None] = lambda why: None):
        """`build()` (in the engine thread) loads the model and returns the Engine (with its
        scheduler, sized once the weights are in memory). `on_fatal(why)`: the ranks of a
        multi-rank server lost each other (module docstring)."""
        self.build, self.max_waiting, self.metrics, self.on_load_error = build, max_waiting, metrics, on_load_error
        self.on_fatal = on_fatal
        self.health = GroupHealth()
        """Whether this server's ranks are still in step (launch/rank_loop.py)."""
        self.scheduler: Scheduler | None = None
        self.ready = threading.Event()
        self.accepting = True
        self._wake = threading.Condition()
        self._incoming: list[Handle] = []
        self._aborts: list[Handle] = []
        self._end_all: str | None = None
        self._stop = False
        self._waiting = 0
        self._queue = QueueShape(0, 0)
        """What a new request queues behind, as of the last step (for SLO admission)."""
        self.thread = threading.Thread(target=self._run, name="phalanx-engine", daemon=True)

    @property
    def failed(self) -> str | None:
        """Why this server can no longer serve (a rank died); None while it can."""
        return self.health.failed

    def start(self) -> None:
        self.thread.start()

    def positions(self) -> int:
        """Positions the KV cache holds in all (0 while loading): a sequence never has more."""
        if self.scheduler is None:
            return 0
        one = self.scheduler.parts[0] if hasattr(self.scheduler, "parts") else self.scheduler  # dp: one rank's cache
        return one.blocks.num_blocks * one.block_size

    def submit(self, seq: Sequence, text: IncrementalText) -> Handle:
        if not self.ready.is_set():
            raise NotAccepting("the model is still loading")
        if self.failed:
            raise NotAccepting(self.failed)
        if not self.accepting:
            raise NotAccepting("the server is shutting down")
        self.scheduler.check_fits(len(seq.prompt), seq.max_tokens)  # ValueError: never fits
        handle = Handle(seq, text, asyncio.get_running_loop())
        seq.payload = handle
        seq.arrival = time.monotonic()  # the scheduler's clock: TTFT counts from here
        with self._wake:
            if self._waiting + len(self._incoming) >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are waiting already; try again later")
            if self.scheduler.slo is not None:  # SloUnattainable: its TTFT target cannot be met
                queue = self._queue.plus([len(h.seq.tokens) for h in self._incoming])
                self.scheduler.slo.check_admission(queue, len(seq.prompt))
            self._incoming.append(handle)
            self._wake.notify()
        return handle

    def abort(self, handle: Handle) -> None:
        if not handle.done:
            with self._wake:
                self._aborts.append(handle)
                self._wake.notify()

    def end_all(self, message: str) -> None:
        """End every request still running or waiting with an error (the shutdown grace ran out)."""
        with self._wake:
            self._end_all = message
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        name_this_thread(self.thread.name)  # tells it from the HTTP server's threads in top -H and /proc
        try:
            engine = self.build()
        except BaseException as error:  # reported by the server, which then exits
            self.on_load_error(error)
            return
        self.scheduler = engine.scheduler
        channel = engine.channel  # None in one process
        wait_s = IDLE_WAIT_S if channel is None else min(IDLE_WAIT_S, channel.heartbeat_s)
        self.ready.set()
        while True:
            with self._wake:
                if not (self._incoming or self._aborts or self._end_all or self._stop or self.scheduler.has_work()):
                    self._wake.wait(wait_s)
                if self._stop:
                    self._close(engine)
                    return
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
                end_all, self._end_all = self._end_all, None
            self._apply(incoming, aborts, end_all)
            try:
                if self.scheduler.has_work():
                    self._step(engine)
                else:
                    self.metrics.after_step(self.scheduler, 0, engine.take_expert_rows())
                    if channel is not None:
                        channel.keep_alive()
            except Exception as error:
                if channel is not None:  # the ranks are out of step for good: exit, to be restarted
                    self._fail(error)
                    return
                # A bug in one process: the step's requests get an error, the server goes on.
                traceback.print_exc(file=sys.stderr)
                self._end_step("the engine failed on this batch (a bug; see the server's log)")
            self._waiting = len(self.scheduler.waiting)
            if self.scheduler.slo is not None:
                self._queue = self.scheduler.queue_shape()

    def _close(self, engine) -> None:
        try:
            engine.close()  # tells the other ranks to stop
        except RuntimeError as error:
            print(f"phalanx: the other ranks could not be told to stop: {first_line(error)}", file=sys.stderr, flush=True)

    def _fail(self, error: BaseException) -> None:
        """A multi-rank server whose ranks lost each other: every request ends with a clear
        error, new ones are refused, and the server is told to exit (non-zero)."""
        why = self.health.lost(error)
        with self._wake:
            incoming, self._incoming = self._incoming, []
        for handle in incoming:
            handle.put(Piece("", error=self.failed, code="engine_failed"))
        self._end_everything(self.failed, code="engine_failed")
        self.on_fatal(f"the server's ranks lost each other: {why}")

    def _apply(self, incoming: list[Handle], aborts: list[Handle], end_all: str | None) -> None:
        for handle in incoming:
            try:
                self.scheduler.add(handle.seq)
            except QueueFull as error:  # the queue filled between submit and this step: as submit says, 429
                handle.put(Piece("", error=str(error), status=429, code="queue_full"))
            except ValueError as error:
                handle.put(Piece("", error=str(error), status=400, code="invalid_request"))
        for handle in aborts:
            if self.scheduler.abort(handle.seq):
                handle.done = True
                self.metrics.request_done(handle.seq, "abort")
        if end_all:
            self._end_everything(end_all)

    def _end_everything(self, message: str, code: str = "aborted") -> None:
        self._end(list(self.scheduler.running) + list(self.scheduler.waiting), message, code)

    def _end_step(self, message: str) -> None:
        """End the sequences of the step that failed (the rest wait on)."""
        step = getattr(self.scheduler, "last_step", None)
        self._end([chunk.seq for chunk in step.chunks] if step else list(self.scheduler.running), message,
                  "engine_error", 500)

    def _end(self, seqs, message: str, code: str, status: int = 503) -> None:
        for seq in seqs:
            if self.scheduler.abort(seq, "error"):
                self.metrics.request_done(seq, "error")
                seq.payload.put(Piece("", error=message, status=status, code=code))

    def _step(self, engine) -> None:
        began = time.monotonic()
        events = engine.step()
        if self.scheduler.slo is not None:  # what this step's shape took, for the step-time fit
            self.scheduler.slo.observe(self.scheduler.last_step, time.monotonic() - began)
        # One wake-up of the handlers' loop per step, not one per token: each wake-up is a
        # write to the loop's self-pipe here and a turn of the loop there.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Handle, Piece]]] = {}
        for event in events:
            seq, handle = event.seq, event.seq.payload
            if handle.done:  # a stop string ended it at an earlier token of this step (guessed tokens)
                continue
            if event.error is not None:  # this request alone failed (its sampling)
                out = Piece("", error=event.error, status=500, code="sampling_failed")
                handle.mark(out)
                by_loop.setdefault(handle.loop, []).append((handle, out))
                self.metrics.request_done(seq, "error")
                continue
            finish = event.finish_reason
            # An end-of-sequence or stop token leaves no text, unless include_stop_str_in_output (as vLLM).
            ends = finish == "stop" and event.token in seq.eos_ids and not handle.text.keep_stop
            piece = "" if ends else handle.text.add(event.token)
            if handle.text.stopped and finish is None:
                self.scheduler.finish(seq, "stop")
                finish = "stop"
            elif finish:
                piece += handle.text.finish()
            out = Piece(piece, event.token, event.logprob, event.top_logprobs, finish, prompt_logprobs=event.prompt_logprobs,
                        cached_tokens=seq.cached_tokens)
            handle.mark(out)
            by_loop.setdefault(handle.loop, []).append((handle, out))
            if finish:
                self.metrics.request_done(seq, finish)
        # The metrics first: a client that reads /metrics once its answer came must see this step.
        self.metrics.after_step(self.scheduler, len(events), engine.take_expert_rows())
        for loop, pieces in by_loop.items():
            loop.call_soon_threadsafe(deliver, pieces)
