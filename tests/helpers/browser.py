"""Debian's Chromium, headless, as the builder page's tests and benchmark drive it through Playwright, and
`zerotune builder` started as a user starts it (in a folder of theirs; its printed URL carries the token)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.cli import stop_process

CHROMIUM = "/usr/bin/chromium"  # Debian's package (make setup installs it); Playwright downloads no browser
# Chromium's own network traffic is refused on these machines: these flags keep it from trying.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
PRINTED_URL = re.compile(r"(http://127\.0\.0\.1:(\d+)/)\?token=([\w-]+)")


def launch(playwright, extra_args: list[str] = ()):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=[*CHROMIUM_ARGS, *extra_args])


@dataclass
class Builder:
    proc: subprocess.Popen
    base: str            # http://127.0.0.1:<port>/
    port: int
    token: str
    output: list[str]    # what the server printed after its URL

    @property
    def url(self) -> str:
        """The address the server printed: the page, with its token."""
        return f"{self.base}?token={self.token}"


def start_builder(env: dict, *args: str, cwd: Path) -> Builder:
    """`zerotune builder --port 0 ARGS` run in `cwd` (where its experiments and results are: never the
    checkout), once it has printed its URL; stop it with stop_builder."""
    proc = subprocess.Popen([sys.executable, "-m", "zerotune", "builder", "--port", "0", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            found = PRINTED_URL.search(line)
            if found:
                break
        else:
            raise AssertionError("the builder did not print its URL:\n" + "".join(seen[-40:]))
    except BaseException:
        stop_builder(proc)
        raise
    output: list[str] = []
    # Read on, so that a full pipe never blocks the server's logging.
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    return Builder(proc, found.group(1), int(found.group(2)), found.group(3), output)


def stop_builder(proc: subprocess.Popen) -> None:
    stop_process(proc)
