"""`zerotune builder`: serve the config builder page on this machine.

    zerotune builder                      # http://127.0.0.1:8765/?token=...
    zerotune builder --port 0             # any free port (the URL printed says which)
    zerotune builder --config-dir DIR     # experiments saved in DIR/experiment/ (default: ./zerotune/experiment/)
    zerotune builder --host 0.0.0.0       # reachable from other machines: the page can write experiments

Results are read from the working directory's multirun/ and outputs/, where `zerotune train` run there
writes them.

The URL carries a token made at each start: every request needs it (the page keeps it in a cookie). The
server answers only requests addressed to this machine (localhost, 127.0.0.1, [::1], --host; with --host
0.0.0.0 also this machine's names and any IP address); --allow-host adds a name, such as a DNS alias.

`python -m zerotune builder`: the config builder page (zerotune/cli/builder.py)."""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys

import uvicorn

from zerotune.builder.access import allowed_hosts, new_token
from zerotune.builder.app import create_app
from zerotune.config import search
from zerotune.config.errors import ConfigError, report_config_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerotune builder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="another name of this machine the page may be opened by (repeatable)")
    search.add_config_dir_option(parser)  # the page saves experiments in its experiment/ folder
    parser.add_argument("--no-token", action="store_true",
                        help="serve without the token: any program or web page that reaches the port can use it")
    args = parser.parse_args(argv)
    try:
        search.choose_and_warn(args.config_dir)
    except ConfigError as exc:
        return report_config_error(exc)
    # Bound here, not by uvicorn, so that the URL printed carries the real port when --port 0 is given.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(128)  # from here a browser's connection waits in the queue instead of being refused
    except OSError as exc:
        print(f"zerotune: cannot listen on {args.host}:{args.port}: {exc.strerror}; try --port 0", file=sys.stderr)
        return 2
    token = None if args.no_token else new_token()
    if token is None:
        print("zerotune: --no-token: any program on this machine, and any web page its browser opens, can use "
              "the builder and write experiment files", file=sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout: it stays the URL's
        app = create_app(token=token, hosts=allowed_hosts(args.host, args.allow_host))
    host, port = sock.getsockname()[:2]
    query = f"?token={token}" if token else ""
    print(f"zerotune config builder: http://{'[' + host + ']' if ':' in host else host}:{port}/{query}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
