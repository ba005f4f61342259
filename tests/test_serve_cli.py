"""``blockspec serve`` as a process: its flags, graceful shutdown on SIGTERM/SIGINT (a running
stream ends with an error event, the process exits 0, nothing hangs) and a busy port."""
from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from blockspec.cli import build_parser as _parser  # noqa: E402
from blockspec.tiny_model import write_tiny_model  # noqa: E402


def test_serve_flags_and_defaults():
    ns = _parser().parse_args(["serve"])
    assert (ns.host, ns.port, ns.api_key, ns.served_model_name) == ("127.0.0.1", 30000, None, None)
    assert ns.model_path is None                      # unset: the shipped demo family
    ns = _parser().parse_args([
        "serve", "--model-path", "P", "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", "D", "--host", "0.0.0.0", "--port", "1234",
        "--api-key", "K", "--max-running-requests", "8", "--max-total-tokens", "4096",
        "--served-model-name", "N", "--max-queued-requests", "5"])
    assert (ns.model_path, ns.speculative_algorithm, ns.speculative_draft_model_path) == ("P", "DFLASH", "D")
    assert (ns.host, ns.port, ns.api_key, ns.served_model_name) == ("0.0.0.0", 1234, "K", "N")
    assert (ns.max_running_requests, ns.max_total_tokens, ns.max_queued_requests) == (8, 4096, 5)


class _Proc:
    """A ``blockspec serve`` subprocess whose stderr is read on a thread."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "blockspec.cli", "serve", *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.err.append(line)
            self.lines.put(line)

    def url(self, timeout: float = 120.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.p.poll() is None, "".join(self.err)
                continue
            if " on http://" in line:
                return line.split(" on ")[1].split()[0]
        raise AssertionError("server did not start: " + "".join(self.err))

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve_cli") / "demo")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_graceful_shutdown_ends_streams_with_an_error_event(folder, sig):
    """A stream still running when --graceful-shutdown-timeout has passed ends with an error
    event and [DONE]; the process exits 0."""
    proc = _Proc("--model-path", str(folder), "--device", "cpu", "--port", "0",
                 "--max-total-tokens", "8192", "--graceful-shutdown-timeout", "1")
    try:
        url = proc.url()
        assert url.startswith("http://127.0.0.1:")
        body = {"prompt": "a long one", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            first = [next(lines) for _ in range(6)]
            assert all(json.loads(x[6:])["choices"] for x in first if x.startswith("data: "))
            t0 = time.monotonic()
            proc.p.send_signal(sig)
            rest = [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == "shutting_down" and "shutting down" in err["message"]
        assert proc.p.wait(30) == 0
        assert time.monotonic() - t0 < 30
        assert f"stopped ({sig.name})" in "".join(proc.err)
        assert "Traceback" not in "".join(proc.err)
    finally:
        proc.kill()


def _wait_in_engine(url: str, n: int, timeout: float = 60.0) -> None:
    """Until the engine holds ``n`` requests (running + waiting, from /metrics): a signal sent
    after this reaches requests that are surely in flight, however slow the machine."""
    end = time.monotonic() + timeout
    held = -1.0
    while time.monotonic() < end:
        text = httpx.get(url + "/metrics", timeout=10).text
        held = sum(float(ln.split()[-1]) for ln in text.splitlines()
                   if ln.startswith(("blockspec_num_running_reqs ", "blockspec_num_queue_reqs ")))
        if held >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine held {held} requests after {timeout} s, expected {n}")


def test_busy_port_is_one_line_error(folder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "blockspec.cli", "serve", "--model-path", str(folder),
                            "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], r.stderr


def test_sigterm_drains_running_and_queued_requests(folder):
    """SIGTERM: new connections are refused at once, but the stream, the blocking request and
    the request queued behind them (one runs at a time) all finish in full within
    --graceful-shutdown-timeout; the stream gets its last chunk and [DONE]."""
    proc = _Proc("--model-path", str(folder), "--device", "cpu", "--port", "0",
                 "--max-running-requests", "1", "--graceful-shutdown-timeout", "60")
    try:
        url = proc.url()
        results: dict = {}

        def blocking(name: str, max_tokens: int) -> None:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
            results[name] = (r.status_code, r.json())

        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "prompt": "stream", "max_tokens": 150, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            threads = [threading.Thread(target=blocking, args=(n, 40)) for n in ("block", "queued")]
            for t in threads:
                t.start()
            _wait_in_engine(url, 3)       # the stream runs, the other two wait behind it
            proc.p.send_signal(signal.SIGTERM)
            end = time.monotonic() + 30
            while True:                   # soon no longer accepting, while the three drain
                try:
                    httpx.get(url + "/health", timeout=5)
                except (httpx.ConnectError, httpx.RemoteProtocolError):
                    break     # refused, or accepted in the instant of closing and closed unanswered
                assert time.monotonic() < end, "still accepting connections 30 s after SIGTERM"
                time.sleep(0.05)
            events = [x[6:] for x in lines if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 150
        for t in threads:
            t.join(120)
        for name in ("block", "queued"):
            status, body = results[name]
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 40
        assert proc.p.wait(60) == 0
        assert "Traceback" not in "".join(proc.err)
    finally:
        proc.kill()


def test_sigterm_ends_what_outlives_the_timeout_with_a_clear_error(folder):
    proc = _Proc("--model-path", str(folder), "--device", "cpu", "--port", "0",
                 "--graceful-shutdown-timeout", "1")
    try:
        url = proc.url()
        result: dict = {}

        def blocking() -> None:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": "long", "max_tokens": 4000, "ignore_eos": True})
            result["r"] = (r.status_code, r.json())

        t = threading.Thread(target=blocking)
        t.start()
        _wait_in_engine(url, 1)
        t0 = time.monotonic()
        proc.p.send_signal(signal.SIGTERM)
        t.join(60)
        status, body = result["r"]
        assert status == 503 and body["error"]["code"] == "shutting_down", body
        assert "graceful-shutdown-timeout" in body["error"]["message"]
        assert proc.p.wait(30) == 0 and time.monotonic() - t0 < 20
    finally:
        proc.kill()
