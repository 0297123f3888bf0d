"""One engine instance of a pool: a `phalanx serve` process (with `--nproc N` workers) on
127.0.0.1 and a free port, over the ranks the router gave it (on a GPU, those devices through
CUDA_VISIBLE_DEVICES; on the CPU, N processes). Started, waited for until healthy, stopped
with SIGTERM (it lets running requests finish, as `phalanx serve` always does).

The instances stay in the front's process group, so a signal to the group (Ctrl-C, or a test
killing the server) reaches them too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import h11

from phalanx.serve.pool_proxy import forward, read_all

START_TIMEOUT_S = 600
PREFIX = "phalanx: serving "


class BackendFailed(RuntimeError):
    pass


def backend_command(flags: list[str], plan: str, world: int) -> list[str]:
    """`flags`: the front's own flags that every instance shares (not --pool, --host, --port)."""
    return [sys.executable, "-m", "phalanx", "serve", *flags, "--host", "127.0.0.1", "--port", "0",
            "--nproc", str(world), "--plan", plan]


def visible_devices(ranks: tuple[int, ...], device: str) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for an instance over `ranks` (indices into the devices this
    process sees); nothing on the CPU."""
    if device == "cpu":
        return {}
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = seen.split(",") if seen else [str(index) for index in range(max(ranks) + 1)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[rank] for rank in ranks)}


class Backend:
    def __init__(self, label: str, command: list[str], env: dict[str, str]):
        self.label, self.command, self.env = label, command, env
        self.process: asyncio.subprocess.Process | None = None
        self.address: tuple[str, int] | None = None
        self.stopping = False
        """Stopped on purpose (a move, the front's shutdown): its exit is no failure."""

    async def start(self) -> tuple[str, int]:
        """Start it and wait until it is healthy; its address."""
        self.process = await asyncio.create_subprocess_exec(*self.command, stdout=asyncio.subprocess.PIPE,
                                                            env={**os.environ, **self.env})
        try:
            line = (await asyncio.wait_for(self.process.stdout.readline(), START_TIMEOUT_S)).decode()
        except asyncio.TimeoutError:
            await self.kill()
            raise BackendFailed(f"{self.label} printed nothing in {START_TIMEOUT_S} s") from None
        if not line.startswith(PREFIX):
            code = await self.process.wait()
            raise BackendFailed(f"{self.label} exited with status {code} before serving")
        asyncio.get_running_loop().create_task(self._relay())
        port = int(line.rstrip().rsplit(":", 1)[1])
        self.address = ("127.0.0.1", port)
        while not await self._healthy():
            if self.process.returncode is not None:
                raise BackendFailed(f"{self.label} exited with status {self.process.returncode} while loading")
            await asyncio.sleep(0.2)
        return self.address

    async def _healthy(self) -> bool:
        try:
            answer = await forward(self.address, "GET", "/health", [])
            await read_all(answer)
            return answer.status == 200
        except (OSError, h11.ProtocolError):  # not up yet, or gone
            return False

    async def _relay(self) -> None:
        """Its later stdout lines, to the front's log, named."""
        while self.process.stdout is not None:
            line = await self.process.stdout.readline()
            if not line:
                return
            print(f"[{self.label}] {line.decode().rstrip()}", file=sys.stderr, flush=True)

    async def metrics(self) -> str:
        answer = await forward(self.address, "GET", "/metrics", [])
        return (await read_all(answer)).decode()

    async def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Signal it and wait for it to exit (it drains its own running requests first)."""
        self.stopping = True
        if self.process is None or self.process.returncode is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(sig)
        return await self.process.wait()

    async def exited(self) -> str:
        """Wait for the process to end; how it did, in words."""
        code = await self.process.wait()
        return f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"

    async def kill(self) -> None:
        self.stopping = True
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
