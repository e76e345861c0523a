"""Run one HTTP request through an ASGI app in this process and hand back its messages as they
come: the replica serves the ingress's requests with the single server's own app, so endpoints,
errors, tenants and streaming are the same by construction."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def asgi_call(
    app, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> AsyncIterator[dict]:
    """Yields {"status", "headers"} once, then {"body": bytes} chunks. Closing the iterator early
    (the caller left) tells the app the client disconnected."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:
                if task.exception() is not None:
                    raise task.exception()
                return
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": [(k, v) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield {"body": message["body"]}
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5)
            except (TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()
