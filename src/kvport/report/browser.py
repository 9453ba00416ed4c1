"""Open a report page in a real headless browser (Chromium) and read back what it rendered.

``chromium --headless --dump-dom`` loads the page, runs its script (which marks how many figures
decoded, :mod:`kvport.report.page`) and prints the DOM; the browser's own log (``--enable-logging``)
carries every console message and uncaught error of the page. :func:`check` returns both, for the
test that keeps the page honest and for ``kvport report --check``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from kvport.errors import UserInputError

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_CONSOLE = re.compile(r":CONSOLE\(\d+\)\]|Uncaught ")


@dataclass(frozen=True, slots=True)
class BrowserCheck:
    figures_loaded: str | None  # "N/M" as the page's script wrote it; None: the script never ran
    page_errors: tuple[str, ...]  # what the page's script recorded (figures that did not decode, errors)
    console: tuple[str, ...]  # the browser's console lines for the page

    @property
    def ok(self) -> bool:
        if self.figures_loaded is None or self.page_errors or self.console:
            return False
        done, _, total = self.figures_loaded.partition("/")
        return done == total


class _Body(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.attrs: dict[str, str | None] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body":
            self.attrs = dict(attrs)


def find_browser() -> str | None:
    return next((p for name in BROWSERS if (p := shutil.which(name))), None)


def check(page: Path, timeout_s: float = 120.0) -> BrowserCheck:
    exe = find_browser()
    if exe is None:
        raise UserInputError(f"no browser to check the page with ({', '.join(BROWSERS)}): on Debian, "
                             "apt-get install chromium (make setup does)")
    with tempfile.TemporaryDirectory(prefix="kvport-browser-") as profile:
        argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
                f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
                "--dump-dom", page.resolve().as_uri()]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise UserInputError(f"{exe} did not finish loading {page} within {timeout_s:g} s") from exc
    body = _Body()
    body.feed(out.stdout)
    errors = body.attrs.get("data-errors") or ""
    console = tuple(line.strip() for line in out.stderr.splitlines() if _CONSOLE.search(line))
    return BrowserCheck(body.attrs.get("data-figures-loaded"), tuple(e for e in errors.split(" | ") if e), console)
