"""Whether this machine can run the browser tests, and what to do when it cannot."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("AMPNB_BROWSER_ARTIFACTS", ROOT / "artifacts" / "browser"))
SHOTS: list[Path] = []  # screenshots written in this run, listed at the end of the output
HOW_TO_ENABLE = ("install Chromium (Debian/Ubuntu: `sudo apt-get install chromium`) and "
                 "`pip install playwright jupyterlab` (or `pip install -e '.[test]'`); "
                 "set AMPNB_REQUIRE_BROWSER=1 to make this a failure")


def skip_or_fail(reason: str) -> None:
    """Skip with how to enable the browser tests; fail instead when CI requires them."""
    message = f"browser tests not run: {reason}; {HOW_TO_ENABLE}"
    if os.environ.get("AMPNB_REQUIRE_BROWSER") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def find_chromium() -> str | None:
    """Debian's chromium (or the headless shell), so that playwright downloads nothing."""
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser",
                 "/usr/bin/chromium-headless-shell", "chromium-headless-shell"):
        found = shutil.which(name)
        if found:
            return found
    return None


def missing() -> str | None:
    """What the browser tests lack on this machine, or None when they can run."""
    if find_chromium() is None:
        return "no chromium executable found"
    for module, what in (("playwright", "python playwright"), ("jupyterlab", "jupyterlab")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed"
    return None
