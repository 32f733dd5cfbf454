"""Headless Chromium driven over the DevTools protocol through a pipe (--remote-debugging-pipe):
no driver, no WebSocket library, nothing but the browser (Debian's `chromium`).

    with Chromium() as browser:
        page = browser.open("file:///…/report.html")   # waits for the load event
        page.evaluate("document.title")
        page.screenshot("shot.png")
        page.problems()                               # console errors, exceptions, non-file requests

The browser writes one JSON message per NUL-terminated frame on fd 4 and reads ours on fd 3.
"""
import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--hide-scrollbars")
LOCAL = ("file:", "data:", "about:")  # the schemes a page may load from without a network


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    def __init__(self, path=None, timeout=30.0):
        self.path, self.timeout = path or find_chromium(), timeout
        self.events, self._buf, self._id = [], b"", 0

    def __enter__(self):
        self.profile = tempfile.mkdtemp(prefix="compactionrl-chromium-")
        to_r, self._to = os.pipe()      # our commands: the browser reads fd 3
        self._from, from_w = os.pipe()  # its answers and events: the browser writes fd 4

        def fds():  # in the child, before exec: the two ends at 3 and 4 (moved clear of both first)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_r, from_w)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)
        self.proc = subprocess.Popen([self.path, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     preexec_fn=fds, pass_fds=(3, 4),  # kept: close_fds runs after fds()
                                     stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        return self

    def __exit__(self, *exc):
        try:
            self.send("Browser.close")
        except (OSError, RuntimeError, TimeoutError):
            pass  # already gone: killed below either way
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to)
        os.close(self._from)
        shutil.rmtree(self.profile, ignore_errors=True)

    def send(self, method, params=None, session=None):
        """One command; returns its result, keeping the events that arrive meanwhile."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + self.timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method, session, since=0):
        """The first event `method` of `session` after events[since:], reading on until it comes."""
        deadline = time.time() + self.timeout
        while True:
            for e in self.events[since:]:
                if e.get("method") == method and e.get("sessionId") == session:
                    return e
            since = len(self.events)
            self.events.append(self._read(deadline))

    def _read(self, deadline):
        import select
        while b"\0" not in self._buf:
            if not select.select([self._from], [], [], max(0.0, deadline - time.time()))[0]:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self._from, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited (status {self.proc.poll()})")
            self._buf += chunk
        frame, self._buf = self._buf.split(b"\0", 1)
        return json.loads(frame)

    def open(self, url, width=1500, height=1000):
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.send(f"{domain}.enable")
        page.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})
        since = len(self.events)
        page.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired", session, since)
        return page


class Page:
    def __init__(self, browser, session):
        self.browser, self.session = browser, session

    def send(self, method, params=None):
        return self.browser.send(method, params, self.session)

    def evaluate(self, expression):
        """The value of a JavaScript expression (JSON-able), raising on a thrown exception."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path, full_page=False):
        params = {"format": "png"}
        if full_page:
            size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size[0], "height": size[1],
                                                            "scale": 1})
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.send("Page.captureScreenshot", params)["data"]))

    def problems(self):
        """What went wrong on this page so far: console errors, uncaught exceptions, log entries of
        level error, and every request for something other than a file or inline data."""
        self.evaluate("0")  # a round trip: events sent before it are in
        out = []
        for e in self.browser.events:
            if e.get("sessionId") != self.session:
                continue
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails']}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}")
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
            elif m == "Network.requestWillBeSent" and not p["request"]["url"].startswith(LOCAL):
                out.append(f"request: {p['request']['url']}")
        return out
