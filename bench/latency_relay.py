"""A TCP relay on loopback (one 127.0.1.N address per target) that adds a fixed one-way delay
to every chunk, in each direction: a stand-in for `tc netem delay`, which this machine's kernel
lacks (no sch_netem). Order and bytes are preserved; only the timing changes. Used by
bench/noop_rerun.py only."""

from __future__ import annotations

import asyncio
import threading
import time


class Relay:
    """`with Relay({"name": (host, port)}, delay_s=0.025) as r:` then connect to
    (r.addresses[name], r.ports[name]): each target has its own loopback address, so an inventory
    of relayed hosts names one box per address (donorkit.inventory.values.box_identity)."""

    def __init__(self, targets: dict[str, tuple[str, int]], delay_s: float) -> None:
        self.targets = targets
        self.delay_s = delay_s
        self.ports: dict[str, int] = {}
        self.addresses: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._servers: list[asyncio.Server] = []

    def __enter__(self) -> Relay:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        """Every session cancelled and awaited, the listeners closed, then the loop: nothing is
        left for the garbage collector to finalize on a closed loop."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        for server in self._servers:
            server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        for index, (name, target) in enumerate(self.targets.items()):
            address = f"127.0.1.{index + 1}"
            server = self._loop.run_until_complete(asyncio.start_server(
                lambda r, w, t=target: self._session(r, w, t), address, 0))
            self._servers.append(server)
            self.addresses[name] = address
            self.ports[name] = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       target: tuple[str, int]) -> None:
        up_reader, up_writer = await asyncio.open_connection(*target)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward chunks in order, each released `delay_s` after it arrived."""
        queue: asyncio.Queue = asyncio.Queue()

        async def release() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(release())
        try:
            while data := await reader.read(65536):
                await queue.put((time.monotonic() + self.delay_s, data))
        except ConnectionError:
            pass
        await queue.put(None)
        await sender
