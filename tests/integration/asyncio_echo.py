#!/usr/bin/env python3
"""An asyncio echo server and client, for integration.sdp.asyncio (sdp.py).

  asyncio_echo.py server PORT
  asyncio_echo.py client PORT CONNS MESSAGES SEED

The server echoes every byte on every connection (one event loop, epoll). The client opens
CONNS connections at once, sends MESSAGES messages of random sizes (1 B .. 64 KiB, seeded)
on each, and reads each echo back before the next message, checking every byte; then it
prints "asyncio-result {json}" with the bytes sent and received, and exits 0 only if all
matched.
"""

import asyncio
import json
import random
import resource
import sys


async def serve(port):
    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def one(port, messages, rng):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    for _ in range(messages):
        msg = rng.randbytes(rng.choice((1, rng.randint(1, 1024), rng.randint(1, 1 << 16))))
        writer.write(msg)
        await writer.drain()
        got = await reader.readexactly(len(msg))
        if got != msg:
            raise RuntimeError(f"echo differs after {sent} bytes")
        sent += len(msg)
    writer.close()
    await writer.wait_closed()
    return sent


async def client(port, conns, messages, seed):
    counts = await asyncio.gather(*(one(port, messages, random.Random(seed + i))
                                    for i in range(conns)))
    total = sum(counts)
    print("asyncio-result " + json.dumps({"conns": conns, "tx": total, "rx": total}),
          flush=True)


def main():
    # Room for many connections (integration.sdp.many): the layer holds more descriptors
    # per connection than the program does.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if sys.argv[1:2] == ["server"] and len(sys.argv) == 3:
        asyncio.run(serve(int(sys.argv[2])))
    elif sys.argv[1:2] == ["client"] and len(sys.argv) == 6:
        asyncio.run(client(*map(int, sys.argv[2:6])))
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
