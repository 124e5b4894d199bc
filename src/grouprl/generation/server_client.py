"""HTTP to a generation server: JSON requests with a per-request timeout and retries, waiting for the server to
come up, and posting a request while this process takes part in a collective the server joins.

Requests use the standard library's HTTP client; connection errors, timeouts and 502/503/504 are retried with
backoff, so a dead server ends the run with an error naming the URL and the settings, never a hang.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Optional

from transformers.utils import logging

logger = logging.get_logger("grouprl")

RETRY_STATUS = {502, 503, 504}
WAIT_NOTE_S = 15.0  # while waiting for a server to answer, a line this often


class ServerError(ConnectionError):
    """The generation server could not be reached, or answered with an error."""


class ServerClient:
    """JSON over HTTP to the server at `base_url`; `timeout` seconds per request, `retries` further attempts."""

    def __init__(self, base_url: str, *, timeout: float = 240.0, retries: int = 3):
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retries = float(timeout), int(retries)
        self.timeout_name = "vllm_server_timeout"  # the setting `timeout` came from, named in errors

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: Optional[bytes] = None,
        retries: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """JSON response of one request, retried on connection errors, timeouts and 502/503/504."""
        url = self.base_url + path
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/octet-stream" if raw is not None else "application/json"}
        attempts = 1 + (self.retries if retries is None else retries)
        wait = self.timeout if timeout is None else timeout
        last: Exception = RuntimeError("no attempt made")
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(url, data=data, headers=headers, method=method), timeout=wait
                ) as response:
                    return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:2000]
                if err.code not in RETRY_STATUS:
                    raise ServerError(f"generation server {method} {url} answered {err.code}: {detail}") from None
                last = err
            except (
                urllib.error.URLError,
                ConnectionError,
                socket.timeout,
                TimeoutError,
                http.client.HTTPException,
            ) as err:
                last = err  # HTTPException: the connection broke mid-answer (a server killed while answering)
        raise ServerError(
            f"generation server {method} {url} failed after {attempts} attempt(s): {getattr(last, 'reason', last)}. "
            f"Settings: {self.timeout_name if timeout is None else 'weight_sync_timeout'}={wait:g}s per request, "
            f"generation_server_retries={self.retries}. Check that the server (`grouprl serve --model ...` or `vllm "
            "serve ...`) is running at that address, or raise these settings."
        )

    def wait_until_ready(self) -> dict:
        """Poll GET /health until it answers (at most `timeout` seconds); return its JSON (empty for vLLM)."""
        started = time.monotonic()
        deadline, next_note = started + self.timeout, started + WAIT_NOTE_S
        while True:
            try:
                return self.health(max(1.0, min(self.timeout, 10.0)))
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as err:
                now = time.monotonic()
                if now >= next_note and now < deadline:  # a wait of minutes says what it waits for
                    logger.warning(
                        f"grouprl: waiting for a generation server at {self.base_url}/health: {now - started:.0f} s "
                        f"of vllm_server_timeout={self.timeout:g}s ({getattr(err, 'reason', err)}); start it with "
                        "`grouprl serve --model PATH --port N` (or `vllm serve ...`)."
                    )
                    next_note = now + WAIT_NOTE_S
                if now >= deadline:
                    raise ServerError(
                        f"no generation server answered at {self.base_url}/health within "
                        f"vllm_server_timeout={self.timeout:g}s ({getattr(err, 'reason', err)}). Start one first "
                        "(`grouprl serve --model PATH --port N`) and point vllm_server_base_url (or vllm_server_host / "
                        "vllm_server_port) at it."
                    ) from None
                time.sleep(min(1.0, max(deadline - time.monotonic(), 0.05)))

    def health(self, timeout: float) -> dict:
        """GET /health once (raises the connection error); its JSON, empty when the server sends none (vLLM)."""
        with urllib.request.urlopen(self.base_url + "/health", timeout=timeout) as response:
            body = response.read()
        try:
            return json.loads(body) if body else {}
        except json.JSONDecodeError:
            return {}

    def while_posting(self, path: str, body: dict, work: Callable[[], Any], timeout: Optional[float] = None) -> None:
        """POST `body` in a thread while this thread runs `work` (the collective the server joins)."""
        errors: list[Exception] = []

        def post() -> None:
            try:
                self.request("POST", path, body, retries=0, timeout=timeout)
            except Exception as err:  # re-raised below, after the collective
                errors.append(err)

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        work()
        thread.join(self.timeout if timeout is None else timeout)
        if errors:
            raise errors[0]


def own_address(base_url: str) -> str:
    """This machine's address as seen from the server (the interface that routes to it)."""
    from urllib.parse import urlparse

    host = urlparse(base_url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "0.0.0.0"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 1))
        return probe.getsockname()[0]


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_base_url(base_url: Optional[str], host: str, port: int) -> str:
    """TRL's rule: vllm_server_base_url wins over host / port."""
    if base_url:
        return base_url.rstrip("/")
    return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
