"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol.

Chromium starts with ``--remote-debugging-port=0`` and prints its websocket address on
stderr; one page target is driven through that websocket (aiohttp's client, on an event loop
of its own in a thread, so tests call it synchronously). Only what the dashboard tests need:
navigate, evaluate JavaScript, type text, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
START_S = 60.0


def find_chromium() -> str | None:
    return next(filter(None, map(shutil.which, BROWSERS)), None)


class Page:
    """One browser tab. Every call blocks until Chromium answers (``timeout_s``)."""

    def __init__(self, ws_url: str, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._session, self._ws = self._run(self._connect(ws_url))
        self._reader = asyncio.run_coroutine_threadsafe(self._read(), self._loop)

    def _run(self, coro, timeout_s: float | None = None):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout_s or self.timeout_s)

    async def _connect(self, ws_url: str):
        session = aiohttp.ClientSession()
        ws = await session.ws_connect(ws_url, max_msg_size=0)
        return session, ws

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            future = self._pending.pop(data.get("id"), None)  # events carry no id
            if future is not None and not future.done():
                future.set_result(data)
        for future in self._pending.values():
            future.set_exception(ConnectionError("the DevTools websocket closed"))

    async def _call(self, method: str, params: dict) -> dict:
        call_id = next(self._ids)
        future = self._loop.create_future()
        self._pending[call_id] = future
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        reply = await future
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def send(self, method: str, **params) -> dict:
        return self._run(self._call(method, params))

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited)."""
        got = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in got:
            raise RuntimeError(f"{expression!r}: {got['exceptionDetails']}")
        return got["result"].get("value")

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll ``expression`` until it is truthy; the page's text is in the failure."""
        end = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(RuntimeError):
                value = self.eval(expression)
                if value:
                    return value
            if time.monotonic() > end:
                raise AssertionError(f"{what}: not seen in {timeout_s} s; page:\n{self.text()}")
            time.sleep(0.25)

    def insert_text(self, text: str) -> None:
        """Types ``text`` into the focused element, as a user (React sees the input events)."""
        self.send("Input.insertText", text=text)

    def screenshot(self, path: str, height: int | None = None) -> None:
        """A PNG of the page (its top ``height`` CSS pixels when given)."""
        params: dict = {"format": "png", "captureBeyondViewport": True}
        if height is not None:
            width = self.eval("document.documentElement.scrollWidth")
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        shot = self.send("Page.captureScreenshot", **params)
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._run(self._ws.close(), 5)
            self._run(self._session.close(), 5)
        self._reader.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@contextlib.contextmanager
def chromium(width: int = 1600, height: int = 1000) -> Iterator[Page]:
    """A headless Chromium with a fresh profile (no cookie from an earlier run), its first
    tab as a ``Page``; the browser and profile go after."""
    binary = find_chromium()
    assert binary, "no chromium on PATH (`apt-get install chromium`; the Makefile does it)"
    profile = tempfile.mkdtemp(prefix="slimserve-chromium-")
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    cmd += ["--disable-dev-shm-usage", "--remote-debugging-address=127.0.0.1"]
    cmd += ["--remote-debugging-port=0", f"--user-data-dir={profile}"]
    cmd += [f"--window-size={width},{height}", "about:blank"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, text=True
    )
    page = None
    try:
        port = _devtools_port(proc)
        page = Page(_page_target(port))
        page.send("Page.enable")
        yield page
    finally:
        if page is not None:
            page.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the group this function started
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(proc: subprocess.Popen) -> int:
    """Chromium's 'DevTools listening on ws://127.0.0.1:<port>/...' line."""
    seen = []
    end = time.monotonic() + START_S
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep it drained
            return int(m.group(1))
    raise AssertionError(f"chromium did not start: {''.join(seen)[-2000:]}")


def _page_target(port: int) -> str:
    end = time.monotonic() + START_S
    while True:
        with contextlib.suppress(OSError, ValueError):
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        assert time.monotonic() < end, "chromium has no page target"
        time.sleep(0.2)
