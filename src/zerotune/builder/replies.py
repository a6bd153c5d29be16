"""The page's error answer, and a JSON answer sent straight from ASGI middleware (the size limit, the access
checks), before the app runs."""

from __future__ import annotations

import json


def error_body(key: str, problem: str, fix: str, field: str | None = None) -> dict:
    return {"error": {"key": key, "problem": problem, "fix": fix, "field": field}}


async def send_json(send, status: int, data: dict) -> None:
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
