"""The builder page's web app (FastAPI + Jinja2): the page, and the JSON calls behind its panels."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, Field

from zerotune.builder import form, preview, workspace
from zerotune.builder import preview as fit
from zerotune.builder.access import (
    AccessGuard,
    AllowedHosts,
    allowed_hosts,
    cookie_name,
    error_body,
    send_json,
)
from zerotune.config import search as config_search
from zerotune.config.compose import as_config_error, experiment_names
from zerotune.config.errors import ConfigError
from zerotune.host.platform import detect
from zerotune.plan import gpus

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


log = logging.getLogger(__name__)
HERE = Path(__file__).parent


class FormState(BaseModel):
    choices: dict[str, str] = Field(default_factory=dict)
    values: dict[str, Any] = Field(default_factory=dict)    # the fields the user typed in
    extra: list[str] = Field(default_factory=list)          # overrides the form has no field for


class FitRequest(FormState):
    gpu: str | None = None
    gpu_mib: Any = None


class SaveRequest(FormState):
    name: Any = None             # checked by experiments.save: the body, not the URL, so no path is normalised away
    overwrite: bool = False


class ImportRequest(BaseModel):
    text: str


api = APIRouter(prefix="/api")


@api.post("/preview")
def api_preview(state: FormState):
    return preview.preview(state.choices, state.values, state.extra)


@api.post("/fit")
def api_fit(req: FitRequest):
    return fit.fit(req.choices, req.values, req.extra, req.gpu, req.gpu_mib)


@api.post("/cheapest")
def api_cheapest(req: FitRequest):
    return fit.cheapest(req.choices, req.values, req.extra, req.gpu, req.gpu_mib)


@api.get("/experiments")
def api_experiments():
    return {"names": experiment_names()}


@api.get("/experiment")
def api_load(name: str):
    return workspace.load(name)


@api.post("/experiment")
def api_save(req: SaveRequest):
    return workspace.save(req.name, req.choices, req.values, req.extra, req.overwrite)


@api.post("/import")
def api_import(req: ImportRequest):
    return workspace.import_text(req.text)


@api.get("/sweeps")
def api_sweeps():
    return {"sweeps": workspace.sweeps()}


@api.get("/sweep")
def api_sweep(folder: str, budget_mib: float | None = None):
    return workspace.open_sweep(folder, budget_mib)


@api.get("/file")
def api_file(path: str):
    return FileResponse(workspace.served_file(path))


def create_app(*, token: str | None, hosts: AllowedHosts | None = None):
    """The page and its JSON calls, behind the 1 MiB request limit and the access checks (access.py):
    requests name one of `hosts` (default: this machine's loopback names) and carry `token` (None: no token)."""
    app = FastAPI(title="zerotune config builder", docs_url=None, redoc_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.include_router(api)
    templates = Jinja2Templates(directory=HERE / "templates")
    platform = detect()
    _errors(app)
    # One preview before serving: the validator's first use imports DeepSpeed, and concurrent first imports
    # of it fail half-initialised; it also makes the page's first preview as quick as the next.
    preview.preview({}, {})

    @app.get("/", response_class=HTMLResponse)
    def page(request: Request):
        choices, values = form.defaults()
        search = config_search.current()  # looked for at each load: a folder made since counts
        response = templates.TemplateResponse(request, "index.html", {
            "fields": form.fields(platform), "choices": choices, "values": values, "platform": platform,
            "gpus": list(gpus.CATALOG.values()), "experiments": experiment_names(), "token": token,
            "user_folder": search.user, "experiments_folder": search.experiments_folder()})
        if token is not None and request.query_params.get("token"):  # checked by AccessGuard already
            # The plots' <img> requests cannot send a header: the cookie carries the token for them.
            response.set_cookie(cookie_name(request.scope["server"][1]), token, httponly=True, samesite="strict")
        return response

    return AccessGuard(BodyLimit(app), hosts or allowed_hosts(), token)


def _errors(app: FastAPI) -> None:
    """Bad input is a 4xx naming the key and the fix; anything else a 500 the page shows. Either way the
    server goes on serving."""

    @app.exception_handler(ConfigError)
    def config_error(_: Request, exc: ConfigError):
        return JSONResponse({"error": preview.error_entry(exc)}, status_code=400)

    @app.exception_handler(workspace.ExperimentExists)
    def exists(_: Request, exc: workspace.ExperimentExists):
        return JSONResponse({**error_body("name", str(exc), "confirm, or choose another name", field="name"),
                             "exists": True}, status_code=409)

    @app.exception_handler(OmegaConfBaseException)
    def unresolved(request: Request, exc: OmegaConfBaseException):  # an interpolation read after composing
        return config_error(request, as_config_error(exc, []))

    @app.exception_handler(Exception)
    def unexpected(_: Request, exc: Exception):
        log.exception("builder request failed")
        return JSONResponse(error_body("server", f"{type(exc).__name__}: {exc}",
                                       "the server's log has the traceback; the page keeps working"), status_code=500)
