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

from zerotune import config_search
from zerotune.builder import experiments, fit, form, importing, preview, results
from zerotune.builder.access import AccessGuard, AllowedHosts, allowed_hosts, cookie_name
from zerotune.builder.limits import BodyLimit
from zerotune.builder.replies import error_body
from zerotune.compose import as_config_error
from zerotune.compose.experiment_file import experiment_names
from zerotune.errors import ConfigError
from zerotune.plan import gpus
from zerotune.platform import detect

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
    return experiments.load(name)


@api.post("/experiment")
def api_save(req: SaveRequest):
    return experiments.save(req.name, req.choices, req.values, req.extra, req.overwrite)


@api.post("/import")
def api_import(req: ImportRequest):
    return importing.import_text(req.text)


@api.get("/sweeps")
def api_sweeps():
    return {"sweeps": results.sweeps()}


@api.get("/sweep")
def api_sweep(folder: str, budget_mib: float | None = None):
    return results.open_sweep(folder, budget_mib)


@api.get("/file")
def api_file(path: str):
    return FileResponse(results.served_file(path))


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

    @app.exception_handler(experiments.ExperimentExists)
    def exists(_: Request, exc: experiments.ExperimentExists):
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
