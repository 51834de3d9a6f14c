"""Open a local HTML page in headless Chromium and say what happened: JavaScript errors, requests,
load timing, how much text it shows; take screenshots. For checking the pages tools/report.py writes.

    python -m tools.browser check runs/tiny/eval_stage3/report.html   # exit 1 on a JS error or blank page
    python -m tools.browser screenshot "runs/tiny/eval_stage3/report.html#open=first" out.png [W H]

Standard library only: it starts the system's Chromium (Debian's `chromium` package; $CHROMIUM
names another binary) with a fresh profile and speaks the Chrome DevTools Protocol over a pipe
(--remote-debugging-pipe: JSON messages ending in a NUL byte; the child reads commands on its fd 3
and writes replies and events on its fd 4). Timings are the page's own Navigation Timing and Paint
Timing entries, in ms from navigation start, so the browser's start-up is not counted.
"""
import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--remote-debugging-pipe"]
TIMEOUT_S = 60.0  # longest wait for one protocol reply or for a page's load event

# What the page reports once loaded (ms from navigation start; null where it has no such entry).
PAGE_FACTS = """new Promise(done => {
  const facts = () => {
    const nav = performance.getEntriesByType("navigation")[0];
    const paint = performance.getEntriesByName("first-contentful-paint")[0];
    const mark = performance.getEntriesByName("report-rendered")[0];
    done(JSON.stringify({dom_ready_ms: nav.domContentLoadedEventEnd, load_ms: nav.loadEventEnd,
      first_paint_ms: paint ? paint.startTime : null, rendered_ms: mark ? mark.startTime : null,
      text_chars: document.body ? document.body.innerText.trim().length : 0}));
  };
  // first contentful paint comes a frame or two after the load event; a page that paints nothing
  // (a blank one) never reports it, hence the 3 s limit
  const painted = () => performance.getEntriesByName("first-contentful-paint").length > 0;
  new PerformanceObserver(() => painted() && facts()).observe({type: "paint", buffered: true});
  setTimeout(facts, 3000);
})"""


@dataclass
class PageResult:
    """What opening a page showed."""
    url: str
    errors: list[str] = field(default_factory=list)  # exceptions, console errors, failed loads
    requests: list[str] = field(default_factory=list)  # every URL the page asked for, its own too
    facts: dict = field(default_factory=dict)  # PAGE_FACTS: timings (ms) and text_chars
    values: list = field(default_factory=list)  # the values of the extra expressions, in order
    screenshot: bytes | None = None  # PNG of the viewport, when asked for

    @property
    def blank(self) -> bool:
        return not self.facts.get("text_chars")


def find_chromium() -> str:
    """The Chromium binary: $CHROMIUM, else chromium / chromium-browser / google-chrome on PATH."""
    for name in [os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]:
        if name and shutil.which(name):
            return shutil.which(name)
    raise FileNotFoundError("no Chromium found: install it (Debian: apt-get install chromium) "
                            "or set $CHROMIUM")


class Browser:
    """One headless Chromium with a throw-away profile, driven over the DevTools pipe."""

    def __init__(self, binary: str | None = None):
        self.profile = tempfile.mkdtemp(prefix="rstar2-chromium-")
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()

        def child_fds():  # the protocol's fixed descriptors: commands in on 3, messages out on 4
            a, b = os.dup(to_child), os.dup(from_child)
            os.dup2(a, 3)
            os.dup2(b, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        command = [binary or find_chromium(), *FLAGS, f"--user-data-dir={self.profile}"]
        self.proc = subprocess.Popen(command, preexec_fn=child_fds, close_fds=False,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buffer, self._next_id, self.events = b"", 0, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("Browser.close")
                self.proc.wait(timeout=10)
            except (OSError, TimeoutError, RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        os.close(self._write)
        os.close(self._read)
        shutil.rmtree(self.profile, ignore_errors=True)

    def _message(self, deadline: float) -> dict:
        """The next message from Chromium; events are also kept in self.events."""
        while b"\0" not in self._buffer:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self._read], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe (did it start?)")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message = json.loads(raw)
        if "method" in message:
            self.events.append(message)
        return message

    def wait_for(self, match, timeout: float = TIMEOUT_S) -> dict:
        """The first message, kept events included, for which match(message) is true."""
        for event in self.events:
            if match(event):
                return event
        deadline = time.monotonic() + timeout
        while True:
            message = self._message(deadline)
            if match(message):
                return message

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Run one protocol command and return its result; RuntimeError with Chromium's message."""
        self._next_id += 1
        ident = self._next_id
        message = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._write, data):]
        reply = self.wait_for(lambda m: m.get("id") == ident)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error'].get('message')}")
        return reply["result"]

    def evaluate(self, expression: str, session: str):
        """The value of a JavaScript expression in the page (a promise is awaited); RuntimeError
        if it throws."""
        params = {"expression": expression, "awaitPromise": True, "returnByValue": True}
        result = self.send("Runtime.evaluate", params, session)
        if "exceptionDetails" in result:
            text = result["exceptionDetails"].get("text")
            raise RuntimeError(f"in the page: {text}: {expression[:80]}")
        return result["result"].get("value")


def page_errors(events: list[dict]) -> list[str]:
    """Uncaught exceptions, console.error calls and error log entries (failed or blocked loads)."""
    errors = []
    for event in events:
        method, params = event["method"], event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            exception = details.get("exception", {}).get("description")
            errors.append(exception or details.get("text", "exception"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            args = [str(a.get("value", a.get("description"))) for a in params.get("args", [])]
            errors.append("console.error: " + " ".join(args))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            errors.append(f"{params['entry'].get('source')}: {params['entry'].get('text')}")
    return errors


def file_url(target: str) -> str:
    """A file:// URL for a local path, keeping its #fragment; URLs pass through."""
    if "://" in target:
        return target
    path, _, fragment = target.partition("#")
    return Path(path).resolve().as_uri() + (f"#{fragment}" if fragment else "")


def open_page(target: str, expressions: tuple[str, ...] = (), width: int = 1200,
              height: int = 900, screenshot: bool = False) -> PageResult:
    """Load a page (path[#fragment] or URL) in a fresh headless Chromium, wait for its load event
    and first paint, evaluate `expressions` in order, and take a screenshot if asked."""
    result = PageResult(file_url(target))
    with Browser() as browser:
        target_id = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        attach = {"targetId": target_id, "flatten": True}
        session = browser.send("Target.attachToTarget", attach)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.send(f"{domain}.enable", session=session)
        size = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        browser.send("Emulation.setDeviceMetricsOverride", size, session)
        browser.events.clear()  # only what the page does from here on
        browser.send("Page.navigate", {"url": result.url}, session)
        browser.wait_for(lambda m: m.get("method") == "Page.loadEventFired")
        result.facts = json.loads(browser.evaluate(PAGE_FACTS, session))
        result.values = [browser.evaluate(e, session) for e in expressions]
        if screenshot:
            shot = browser.send("Page.captureScreenshot", {"format": "png"}, session)
            result.screenshot = base64.b64decode(shot["data"])
        result.errors = page_errors(browser.events)
        result.requests = [e["params"]["request"]["url"] for e in browser.events
                           if e["method"] == "Network.requestWillBeSent"]
    return result


def describe(result: PageResult) -> str:
    """A few readable lines: timings, text, requests, errors."""
    f = {k: float("nan") if v is None else v for k, v in result.facts.items()}
    lines = [result.url,
             f"  from navigation start: DOM ready {f['dom_ready_ms']:.0f} ms, load event end "
             f"{f['load_ms']:.0f} ms, first contentful paint {f['first_paint_ms']:.0f} ms, "
             f"report built {f['rendered_ms']:.0f} ms",
             f"  {f['text_chars']} characters of text; {len(result.requests)} request(s)"]
    return "\n".join(lines + [f"  error: {e}" for e in result.errors])


USAGE = """usage: python -m tools.browser check PAGE.html[#fragment]
       python -m tools.browser screenshot PAGE.html[#fragment] OUT.png [WIDTH HEIGHT]"""


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 2 and argv[0] == "check":
        result = open_page(argv[1])
    elif len(argv) in (3, 5) and argv[0] == "screenshot":
        size = {"width": int(argv[3]), "height": int(argv[4])} if len(argv) == 5 else {}
        result = open_page(argv[1], screenshot=True, **size)
    else:
        raise SystemExit(USAGE)
    print(describe(result))
    if result.errors or result.blank:
        raise SystemExit(f"page check failed: {'a blank page' if result.blank else 'errors'}")
    if argv[0] == "screenshot":
        Path(argv[2]).write_bytes(result.screenshot)
        print(f"wrote {argv[2]}")


if __name__ == "__main__":
    main()
