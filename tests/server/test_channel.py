"""The front end's socket to the engine process: every frame the engine's plain multiprocessing Connection writes
arrives whole and in order, whatever its size against one read, and the peer's exit is reported once."""
from __future__ import annotations

import asyncio
import socket
import threading
from multiprocessing.connection import Connection

from engine.server.channel import READ_BYTES, Channel


def test_frames_of_every_size_arrive_whole_and_in_order():
    front, back = socket.socketpair()
    engine = Connection(back.detach())
    # tiny ones that share a read, one that spans several reads, one exactly a read, then tiny again
    messages = [{"i": i} for i in range(50)] + [b"x" * (3 * READ_BYTES + 7), b"y" * READ_BYTES] + list(range(20))

    async def collect() -> tuple[list, int]:
        loop = asyncio.get_running_loop()
        got, done, eofs = [], asyncio.Event(), []
        channel = Channel(front)

        def on_eof():
            eofs.append(1)
            done.set()

        channel.attach(loop, got.append, on_eof)
        writer = threading.Thread(target=lambda: ([engine.send(m) for m in messages], engine.close()))
        writer.start()
        await asyncio.wait_for(done.wait(), 30)
        writer.join()
        return got, len(eofs)

    got, eofs = asyncio.run(collect())
    assert got == messages
    assert eofs == 1
