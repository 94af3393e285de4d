"""One JupyterLab server and one headless Chromium for the whole browser session, torn down also on failure.

* The server: ``jupyter lab`` from this interpreter on 127.0.0.1 (a free port), with a random token, throwaway
  config, data, runtime, settings and workspace folders, serving a temporary folder into which the tests copy
  each notebook (so nothing in the repository gets outputs written). Kernels are this interpreter's ipykernel
  (jupyter_client runs the ``python3`` spec with ``sys.executable``). Stopped with ``POST /api/shutdown``
  (which shuts its kernels down), then terminated, then killed.
* The browser: Debian's Chromium (``/usr/bin/chromium``, or ``MAMBALAB_CHROMIUM``) driven by Playwright with
  that executable; nothing downloads a browser. Every request that is not to this machine is aborted and
  recorded, so the tests also show that the workbook needs no network.
* Without Chromium or Playwright the tests skip, saying what to install, unless ``CI`` is set: there they fail
  (``.ci/run`` installs Chromium first).

Artefacts go to ``build/browser/`` (screenshots, the server's log, the requests aborted; under pytest-xdist
each worker has its own server, browser, log and record of requests, named with the worker's id).
``MAMBALAB_UPDATE_PREVIEWS=1`` also writes each notebook's screenshot to ``docs/previews/`` (the README's
previews), with a 256-colour palette if Pillow is installed.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTEFACTS = ROOT / "build" / "browser"
PREVIEWS = ROOT / "docs" / "previews"
VIEWPORT = {"width": 1280, "height": 800}
# As the machine's notes prescribe: headless, no sandbox (CI runs as root), and none of Chromium's own
# background connections (the network is closed; without these it floods refused connections).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SERVER_START_TIMEOUT_S = 90
# JupyterLab settings for the throwaway settings folder: every cell rendered (no virtual scrolling, so
# checks see every output), widget state saved with the notebook (as papermill saves it: the offline page draws
# widgets from it), and no news or update checks (they would go to the network).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyter-widgets/jupyterlab-manager/plugin": {"saveState": True},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def find_chromium() -> str | None:
    """``MAMBALAB_CHROMIUM`` if set, else Debian's ``/usr/bin/chromium``, else ``chromium`` on PATH; None if
    the one chosen is not an executable file."""
    explicit = os.environ.get("MAMBALAB_CHROMIUM")
    candidates = [explicit] if explicit else ["/usr/bin/chromium", shutil.which("chromium")]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _skip_or_fail(reason: str):
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so the browser tests must run; .ci/run installs Chromium)")
    pytest.skip(f"{reason}; the browser tests need it (skipped outside CI)")


def _worker_suffix() -> str:
    """The worker's id as a suffix ("-gw0", "-gw1", …) under pytest-xdist, whose workers each start a server
    and a browser; an empty string otherwise."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"-{worker}" if worker else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LabServer:
    """A running JupyterLab: its URL, token, the folder it serves, and a small REST client."""

    url: str
    token: str
    root: Path
    process: subprocess.Popen
    log: Path

    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 30):
        request = urllib.request.Request(
            f"{self.url}/api/{path}", method=method, headers={"Authorization": f"token {self.token}"},
            data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
        return json.loads(text) if text else None

    def sessions(self) -> list[dict]:
        return self.api("GET", "sessions")

    def kernels(self) -> list[dict]:
        return self.api("GET", "kernels")

    def shut_down_kernels_of(self, path: str) -> None:
        """Delete every session on ``path`` (relative to the root); the server shuts each kernel down."""
        for session in self.sessions():
            if session.get("path") == path:
                self.api("DELETE", f"sessions/{session['id']}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _write_settings(settings_dir: Path) -> None:
    for plugin, values in LAB_SETTINGS.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _stop(server: LabServer) -> None:
    """Shut the kernels and the server down: politely, then by signal."""
    if server.process.poll() is None:
        try:
            server.api("POST", "shutdown", timeout=10)
        except (urllib.error.URLError, OSError):
            pass
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=10)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        where = os.environ.get("MAMBALAB_CHROMIUM") or "/usr/bin/chromium or on PATH"
        _skip_or_fail(f"no Chromium at {where} (install Debian's `chromium` package, "
                      "or point MAMBALAB_CHROMIUM at a Chromium binary)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _skip_or_fail("Playwright's Python package is missing (pip install -e '.[dev]' installs it)")
    return path


@pytest.fixture(scope="session")
def artefacts() -> Path:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    return ARTEFACTS


@pytest.fixture(scope="session")
def lab_server(chromium_path, artefacts, tmp_path_factory):
    """JupyterLab serving an empty temporary folder (tests copy notebooks there); stopped, kernels included,
    at the end."""
    base = tmp_path_factory.mktemp("jupyterlab")
    root = base / "notebooks"
    root.mkdir()
    dirs = {name: base / name for name in ("config", "data", "runtime", "settings", "workspaces")}
    for d in dirs.values():
        d.mkdir()
    _write_settings(dirs["settings"])
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
           "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]), "IPYTHONDIR": str(base / "ipython")}
    command = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={dirs['settings']}", f"--LabApp.workspaces_dir={dirs['workspaces']}",
        "--LabApp.news_url=None", "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False",
        # window.jupyterapp: the tests read notebook models and kernel status from the page, as
        # JupyterLab's own UI tests (Galata) do; every action still goes through the UI.
        "--LabApp.expose_app_in_browser=True",
    ]
    log = artefacts / f"jupyterlab{_worker_suffix()}.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    server = LabServer(url=f"http://127.0.0.1:{port}", token=token, root=root, process=process, log=log)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"JupyterLab exited with {process.returncode} while starting:\n{server.log_tail()}")
            try:
                server.api("GET", "status", timeout=5)
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within {SERVER_START_TIMEOUT_S} s:\n{server.log_tail()}")
                time.sleep(0.5)
        yield server
    finally:
        _stop(server)


@dataclass
class BlockedRequests:
    """Requests the browser tried to make off this machine (all aborted)."""

    urls: list[str] = field(default_factory=list)

    def route(self, route) -> None:
        parts = urlsplit(route.request.url)
        if parts.scheme in ("http", "https", "ws", "wss") and parts.hostname not in ("127.0.0.1", "localhost"):
            self.urls.append(route.request.url)
            route.abort("blockedbyclient")
        else:
            route.continue_()


@pytest.fixture(scope="session")
def browser(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def blocked_requests(artefacts):
    """The record of aborted requests; written to ``build/browser/blocked_requests.txt`` at the end."""
    blocked = BlockedRequests()
    try:
        yield blocked
    finally:
        (artefacts / f"blocked_requests{_worker_suffix()}.txt").write_text("".join(f"{url}\n" for url in blocked.urls))


@pytest.fixture(scope="session")
def browser_context(browser, blocked_requests):
    """One browser context (one profile) for the session; no request leaves this machine."""
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    context.route("**/*", blocked_requests.route)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture(scope="session")
def screenshot(artefacts):
    """``screenshot(page, name, preview=False)`` saves ``build/browser/<name>.png`` (the viewport); a
    ``preview`` is also copied to ``docs/previews/`` when ``MAMBALAB_UPDATE_PREVIEWS=1``."""

    def save(page, name: str, *, preview: bool = False) -> Path:
        path = artefacts / f"{name}.png"
        page.screenshot(path=str(path))
        if preview and os.environ.get("MAMBALAB_UPDATE_PREVIEWS") == "1":
            PREVIEWS.mkdir(parents=True, exist_ok=True)
            compress_png(path, PREVIEWS / path.name)
        return path

    return save


def compress_png(source: Path, target: Path) -> None:
    """Write ``source`` to ``target`` with a 256-colour palette (a screenshot of JupyterLab loses nothing
    visible; the file shrinks about 2.5×) when Pillow is installed; otherwise copy it as it is."""
    try:
        from PIL import Image
    except ImportError:
        shutil.copyfile(source, target)
        return
    with Image.open(source) as image:
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        palette.save(target, optimize=True)
