"""A bare gRPC sink for `asteria bench transport`: how fast can Python gRPC move bytes here at all?

``python -m asteria_client.bench.grpc_sink`` serves one client-streaming method on
``127.0.0.1:0`` (grpc.aio on uvloop, like the daemon) that receives raw ``bytes`` messages with
no protobuf and no copies of its own, and prints its port. Streaming the same bytes to it in the
same 1 MiB chunks gives the ceiling any gRPC transport written in Python reaches on this machine,
so the daemon's gRPC figures can be read against it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

METHOD = "/asteria.bench.Sink/Upload"
MAX_MESSAGE_BYTES = 64 << 20


async def _upload(messages: AsyncIterator[bytes], context: Any) -> bytes:
    received = 0
    async for message in messages:
        received += len(message)
    return received.to_bytes(8, "little")


async def _serve() -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    handler = grpc.method_handlers_generic_handler(
        "asteria.bench.Sink", {"Upload": grpc.stream_unary_rpc_method_handler(_upload)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


@contextmanager
def sink() -> Iterator[Any]:
    """A running sink in a subprocess; yields a function that uploads an iterable of bytes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asteria_client.bench.grpc_sink"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        )
        upload = channel.stream_unary(METHOD)
        try:
            yield lambda chunks: upload(iter(chunks), timeout=60)
        finally:
            channel.close()
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(_serve())
    except ImportError:
        asyncio.run(_serve())
