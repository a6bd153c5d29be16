"""Debian's Chromium, headless, as the builder page's tests and benchmark drive it through Playwright."""

from __future__ import annotations

CHROMIUM = "/usr/bin/chromium"  # Debian's package (make setup installs it); Playwright downloads no browser
# Chromium's own network traffic is refused on these machines: these flags keep it from trying.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
