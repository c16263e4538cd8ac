"""A real HTTP server on 127.0.0.1 (ephemeral port) that serves scripted /metrics bodies.

Used by the engine collector, scrape and discovery tests. Each path has a
list of answers served in order; the last one repeats. An answer is a body
(``str``) or ``(status, body)`` or ``(status, body, delay_seconds)``. The
server runs in a daemon thread and stops when the ``with`` block ends.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
SHARED_ENGINES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "engines"


class ScriptedServer:
    """``keep_alive``: speak HTTP/1.1 and keep connections open (as engines do); with
    ``drop_idle`` it closes each one after answering without saying so (an idle timeout
    that struck between two scrapes). ``peers`` lists the client port of every request."""

    def __init__(self, routes: dict[str, list], keep_alive: bool = False, drop_idle: bool = False) -> None:
        self.routes = {path: list(answers) for path, answers in routes.items()}
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.peers: list[int] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with server._lock:
                    server.requests.append((self.path, dict(self.headers)))
                    server.peers.append(self.client_address[1])
                    answers = server.routes.get(self.path)
                    answer = (answers.pop(0) if len(answers) > 1 else answers[0]) if answers else (404, "not found")
                if isinstance(answer, str):
                    answer = (200, answer)
                status, body, *rest = answer
                if rest:
                    time.sleep(rest[0])
                data = body.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                if drop_idle:
                    self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


def metrics_server(*bodies) -> ScriptedServer:
    """A server whose /metrics answers ``bodies`` in order."""
    return ScriptedServer({"/metrics": list(bodies)})
