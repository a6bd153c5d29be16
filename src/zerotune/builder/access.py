"""Who may use the page and what it may touch. Paths resolve (symlinks included) inside multirun/, outputs/ or the
user's experiment folder. Against DNS rebinding and forms sent from elsewhere, every request names this machine in
its Host, one that changes anything comes from the page itself (Origin, Sec-Fetch-Site), and all but the static files
carry the token printed with the URL (as Jupyter does). Also the JSON error answers sent from ASGI middleware."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from zerotune.config.errors import ConfigError

RESULT_ROOTS = ("multirun", "outputs")
PICK_A_SWEEP = "pick a sweep from the list, e.g. multirun/<date>/<time>"


def project() -> Path:
    """The working directory: `zerotune train` run here writes its outputs/ and multirun/ here."""
    return Path.cwd()


def imports_dir() -> Path:
    return project() / "outputs" / "builder-imports"


def inside_results(relative: str, key: str = "folder", fix: str = PICK_A_SWEEP) -> Path:
    """`relative` (as the page shows it, e.g. multirun/2026-11-25/10-00-00) inside multirun/ or outputs/."""
    if not isinstance(relative, str) or not relative or "\x00" in relative or Path(relative).is_absolute():
        raise ConfigError(key, f"{relative!r} is not a folder under {' or '.join(RESULT_ROOTS)}/", fix)
    path = (project() / relative).resolve()
    for root in RESULT_ROOTS:
        base = (project() / root).resolve()
        if path == base or base in path.parents:
            return path
    raise ConfigError(key, f"{relative!r} is outside the project's {' and '.join(RESULT_ROOTS)} folders", fix)


def inside_sweep(relative: str, key: str, fix: str) -> None:
    """A job's folder named relative to its sweep's (hydra.sweep.subdir): it may not climb out of it."""
    if "\x00" in relative or Path(relative).is_absolute() or Path(os.path.normpath(relative)).parts[:1] == ("..",):
        raise ConfigError(key, f"{relative!r} is not a folder inside the sweep's folder", fix)


def shown(path: Path) -> str:
    """A path as the page shows it: relative to the project."""
    return str(path.resolve().relative_to(project().resolve()))


def error_body(key: str, problem: str, fix: str, field: str | None = None) -> dict:
    return {"error": {"key": key, "problem": problem, "fix": fix, "field": field}}


async def send_json(send, status: int, data: dict) -> None:
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TOKEN_HEADER = "x-zerotune-token"
PUBLIC_PREFIX = "/static/"  # the page's own CSS and JS: the same for everyone
# name, or [IPv6], then an optional port: what a browser sends (no user, path or spaces)
_HOST = re.compile(r"^(?P<name>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(?::(?P<port>\d{1,5}))?$")


@dataclass(frozen=True)
class AllowedHosts:
    """The names a request's Host may give (any port). Bound to every interface, any IP address is allowed
    too: a rebound page's Host is always its own domain name, never an address."""
    names: frozenset[str]
    any_address: bool = False

    def allows(self, name: str) -> bool:
        return name in self.names or (self.any_address and _is_address(name))


def allowed_hosts(bind: str = "127.0.0.1", extra: Iterable[str] = ()) -> AllowedHosts:
    """localhost and the loopback addresses, the address the server binds, and `extra` (--allow-host);
    bound to every interface (0.0.0.0, ::), also this machine's own names and any IP address."""
    names = {*LOOPBACK_NAMES, *(host_name(n) for n in (bind, *extra) if n)}
    wildcard = bind in WILDCARD_BINDS
    if wildcard:
        names |= {host_name(socket.gethostname()), host_name(socket.getfqdn())}
    return AllowedHosts(frozenset(names), any_address=wildcard)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def cookie_name(port: int) -> str:
    """One cookie per port: browsers share 127.0.0.1's cookies across ports, and two pages may be open."""
    return f"zerotune-token-{port}"


class AccessGuard:
    """ASGI middleware in front of the app. Hand-written rather than Starlette's TrustedHostMiddleware: that
    one answers a plain-text 400 without the fix, and the Origin and token checks belong beside it."""

    def __init__(self, app, hosts: AllowedHosts, token: str | None):
        self.app, self.hosts, self.token = app, hosts, token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan; the app serves no websockets
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is not None:
            return await send_json(send, *refusal)
        await self.app(scope, receive, send)

    def refusal(self, scope) -> tuple[int, dict] | None:
        """(status, error) for a request to refuse, else None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        hosts = [v for k, v in scope["headers"] if k.lower() == b"host"]
        host = headers["host"] if len(hosts) == 1 else None  # two Host headers name no one host
        port = (scope.get("server") or ("", 0))[1]
        return (self._host_refusal(host, port)
                or self._origin_refusal(scope["method"], headers)
                or self._token_refusal(scope, headers, port))

    def _host_refusal(self, host: str | None, port: int) -> tuple[int, dict] | None:
        parsed = parse_host(host)
        if parsed is not None and self.hosts.allows(parsed[0]):
            return None
        shown = repr((host or "")[:100])
        return 403, error_body("host", f"this server answers requests to this machine only, not to Host {shown}",
                           f"open the address `zerotune builder` printed (http://127.0.0.1:{port}/?token=...); "
                           "to reach it by another name of this machine, start it with --allow-host <name>")

    def _origin_refusal(self, method: str, headers: dict[str, str]) -> tuple[int, dict] | None:
        if method in SAFE_METHODS:
            return None
        origin, site = headers.get("origin"), headers.get("sec-fetch-site")
        if site in ("cross-site", "same-site"):
            return 403, error_body("origin", f"a {site} request cannot change anything here",
                               "use the page itself (the address the server printed)")
        if origin is not None and not same_origin(origin, headers.get("host", "")):
            return 403, error_body("origin", f"a request from {origin[:100]!r} cannot change anything here",
                               "use the page itself (the address the server printed)")
        return None

    def _token_refusal(self, scope, headers: dict[str, str], port: int) -> tuple[int, dict] | None:
        if self.token is None or scope["path"].startswith(PUBLIC_PREFIX):
            return None
        given = request_token(scope, headers, port)
        fix = "open the address with ?token=... that `zerotune builder` printed when it started"
        if given is None:
            return 401, error_body("token", "this server needs the token it printed at start", fix)
        if not secrets.compare_digest(given.encode(), self.token.encode()):
            return 403, error_body("token", "the token is not this server's (it changes at every start)", fix)
        return None


def parse_host(host: str | None) -> tuple[str, int | None] | None:
    """(lower-case name without brackets or final dot, port) of a Host header; None when it is not one."""
    found = _HOST.match(host or "")
    if found is None:
        return None
    return host_name(found["name"]), int(found["port"]) if found["port"] else None


def host_name(name: str) -> str:
    return name.strip("[]").rstrip(".").lower()


def same_origin(origin: str, host: str) -> bool:
    """Whether `origin` (scheme://name[:port], as browsers send it) is the page at `host` (the Host header)."""
    default_port = {"http": 80, "https": 443}
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    ours = parse_host(host)
    if ours is None or parts.scheme not in default_port or parts.hostname is None:
        return False
    scheme_port = default_port[parts.scheme]
    return (host_name(parts.hostname), origin_port or scheme_port) == (ours[0], ours[1] or scheme_port)


def request_token(scope, headers: dict[str, str], port: int) -> str | None:
    """The token a request carries: `Authorization: token ...` (or Bearer), X-Zerotune-Token, the page's
    cookie, or ?token=."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() in ("token", "bearer") and value.strip():
        return value.strip()
    if headers.get(TOKEN_HEADER):
        return headers[TOKEN_HEADER]
    cookie = _cookie(headers.get("cookie", ""), cookie_name(port))
    if cookie:
        return cookie
    query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return query[0] if query else None


def _cookie(header: str, name: str) -> str | None:
    """One cookie's value, read by hand: other pages on this host may set cookies SimpleCookie refuses."""
    for pair in header.split(";"):
        key, _, value = pair.strip().partition("=")
        if key == name:
            return value
    return None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
