#!/usr/bin/env python3
"""Many connections at once, for integration.sdp.many (sdp.py).

  many_conns.py PORT CONNS

Opens CONNS connections to an echo server (50 at a time), echoes a message of its own on
each, then sends a message of a different size on every connection at once and reads all
the echoes back, checking every byte. Prints "many-result {json}": connections, bytes
echoed, seconds to open them, seconds for the round on all, and its resident memory with
all of them open.
"""

import asyncio
import json
import os
import resource
import sys
import time


async def open_one(port, i):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    msg = f"connection {i} ".encode() * 8
    writer.write(msg)
    await writer.drain()
    if await reader.readexactly(len(msg)) != msg:
        raise RuntimeError(f"connection {i}: echo differs")
    return reader, writer, len(msg)


async def round_trip(conn, i):
    reader, writer, _ = conn
    msg = bytes([i % 251]) * (i % 2000 + 1)
    writer.write(msg)
    await writer.drain()
    if await reader.readexactly(len(msg)) != msg:
        raise RuntimeError(f"connection {i}: second echo differs")
    return len(msg)


async def main(port, n):
    start = time.monotonic()
    conns = []
    for first in range(0, n, 50):
        conns += await asyncio.gather(*(open_one(port, i) for i in range(first, min(n, first + 50))))
    opened = time.monotonic() - start
    start = time.monotonic()
    sizes = await asyncio.gather(*(round_trip(c, i) for i, c in enumerate(conns)))
    rounds = time.monotonic() - start
    with open(f"/proc/{os.getpid()}/status") as f:
        rss = int(f.read().split("VmRSS:")[1].split()[0])
    for _, writer, _ in conns:
        writer.close()
    tx = sum(c[2] for c in conns) + sum(sizes)
    print("many-result " + json.dumps({"conns": n, "tx": tx, "open_seconds": opened,
                                       "round_seconds": rounds, "rss_kib": rss}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    # Each connection holds three descriptors of the layer's making besides its own.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * int(sys.argv[2]) + 64
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
