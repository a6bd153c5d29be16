"""`python -m zerotune.builder`: serve the config builder page on this machine.

    python -m zerotune.builder                 # http://127.0.0.1:8765/
    python -m zerotune.builder --port 0        # any free port (the URL printed says which)
    python -m zerotune.builder --host 0.0.0.0  # reachable from other machines: the page can write experiments
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys

import uvicorn

from zerotune.builder.app import create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerotune.builder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    args = parser.parse_args(argv)
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
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout: it stays the URL's
        app = create_app()
    host, port = sock.getsockname()[:2]
    print(f"zerotune config builder: http://{'[' + host + ']' if ':' in host else host}:{port}/", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
