"""A real JupyterLab on localhost driven by Debian's Chromium through Python playwright."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _env import ARTIFACTS, ROOT, SHOTS, find_chromium, missing, skip_or_fail

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Lab:
    """A running JupyterLab: where it serves, its token, and the folder it serves."""

    url: str
    token: str
    root: Path

    def notebook_url(self, relpath: str) -> str:
        return f"{self.url}/lab/tree/{relpath}?token={self.token}&reset"


def _wait_until_up(lab: Lab, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{lab.url}/api/status?token={lab.token}", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"jupyter lab did not answer in {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """The folder screenshots go to (named in the test output)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the screenshots this run wrote, whatever the verbosity."""
    if SHOTS:
        terminalreporter.write_sep("-", f"browser screenshots in {ARTIFACTS}")
        for shot in SHOTS:
            terminalreporter.write_line(f"  {shot.name}")


@pytest.fixture(scope="session")
def chromium() -> str:
    reason = missing()
    if reason is not None:
        skip_or_fail(reason)
    return find_chromium()


# JupyterLab settings that keep pop-ups (news, update checks) off the screenshots.
QUIET_SETTINGS = {"@jupyterlab/apputils-extension/notification":
                  {"fetchNews": "false", "checkForUpdates": False}}


def _quiet_settings(folder: Path) -> None:
    for name, values in QUIET_SETTINGS.items():
        path = folder / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values), "utf-8")


@pytest.fixture(scope="session")
def lab(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab serving a temporary copy of notebooks/ (the repository is never written)."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    port, token = _free_port(), uuid.uuid4().hex
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(base / "config"),
           "JUPYTER_RUNTIME_DIR": str(base / "runtime"), "IPYTHONDIR": str(base / "ipython"),
           "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
           # Keep each kernel to the 2 cores the notebooks are budgeted for.
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "MPLBACKEND": "Agg"}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.open_browser=False",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True"]
    if hasattr(os, "getuid") and os.getuid() == 0:
        cmd.append("--allow-root")
    _quiet_settings(base / "settings")
    log = base / "jupyter.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Lab(f"http://127.0.0.1:{port}", token, root)
    try:
        _wait_until_up(server, proc, log)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def browser(chromium: str) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def page(browser: object) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    try:
        yield pg
    finally:
        context.close()
