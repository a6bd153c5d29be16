"""Requests over 1 MiB are refused (413) before the app reads them."""

from __future__ import annotations

from zerotune.builder.replies import error_body, send_json

MAX_BODY = 1 << 20


class BodyLimit:
    """ASGI middleware. Starlette and uvicorn have no body-size limit of their own: this counts the bytes a
    request declares (Content-Length) and those it sends (chunked), and answers 413 past MAX_BODY."""

    def __init__(self, app, max_body: int = MAX_BODY):
        self.app, self.max_body = app, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            return await _too_large(send, self.max_body)
        seen, refused = 0, False

        async def counted():
            # Past the limit: answer 413 here, and tell the app the client left (the framework would turn
            # an exception raised while it reads the body into its own 400).
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                refused = True
                await _too_large(send, self.max_body)
                return {"type": "http.disconnect"}
            return message

        async def unless_refused(message):
            if not refused:
                await send(message)

        await self.app(scope, counted, unless_refused)


async def _too_large(send, limit: int) -> None:
    await send_json(send, 413, error_body("request", f"the request is over {limit // (1 << 20)} MiB",
                                          "paste a smaller file (a DeepSpeed JSON is a few KiB)"))
