"""A JSON answer sent straight from ASGI middleware (the size limit, the access checks), before the app runs."""

from __future__ import annotations

import json


async def send_json(send, status: int, data: dict) -> None:
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
