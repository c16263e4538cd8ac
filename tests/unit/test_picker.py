"""The endpoint picker's protocol handling, driven with real ext_proc messages and a real balancer.

Envoy's part is played by constructing the ``ProcessingRequest`` messages it
sends; the replies are the serialised bytes the servicer yields, parsed back.
(The same paths with a real Envoy: tests/integration/test_picker_envoy.py.)
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from grpc.aio import EOF

from llmdiag.cli.main import EX_USAGE, main
from llmdiag.config import Config, ConfigError
from llmdiag.config.picker import PickerConfig, split_listen
from llmdiag.model import Backend
from llmdiag.picker import protocol
from llmdiag.picker.bootstrap import envoy_bootstrap
from llmdiag.picker.request import BadRequest, parse_request_body
from llmdiag.picker.service import EndpointPickerService
from llmdiag.router_feedback.balancer import Balancer

A = Backend.from_url("http://10.0.0.1:8000", name="a", models=("m",))
B = Backend.from_url("http://10.0.0.2:8000", name="b", models=("m",))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_service(**config) -> tuple[EndpointPickerService, Clock]:
    clock = Clock()
    balancer = Balancer([A, B], clock=clock, rng=random.Random(1))
    return EndpointPickerService(balancer, PickerConfig(**config), clock=clock), clock


def headers_msg(pairs: dict[str, str], eos: bool = False, response: bool = False) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    h = pb.HttpHeaders(headers=hm, end_of_stream=eos)
    return pb.ProcessingRequest(response_headers=h) if response else pb.ProcessingRequest(request_headers=h)


def body_msg(data: bytes, eos: bool = True, response: bool = False) -> pb.ProcessingRequest:
    b = pb.HttpBody(body=data, end_of_stream=eos)
    return pb.ProcessingRequest(response_body=b) if response else pb.ProcessingRequest(request_body=b)


def with_subset(msg: pb.ProcessingRequest, endpoints: list[str]) -> pb.ProcessingRequest:
    hint = struct_pb2.Struct()
    hint.update({protocol.SUBSET_KEY: endpoints})
    msg.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].CopyFrom(hint)
    return msg


class Context:
    """grpc.aio's servicer context as the picker uses it: ``read()`` until EOF, ``write(bytes)``."""

    def __init__(self, messages: list, cancel_after: int | None) -> None:
        self.messages = list(messages)
        self.cancel_after = cancel_after
        self.sent = 0
        self.replies: list[pb.ProcessingResponse] = []

    async def read(self):
        while self.messages and callable(self.messages[0]):
            self.messages.pop(0)()  # a clock step between two messages
        if self.cancel_after is not None and self.sent == self.cancel_after:
            raise asyncio.CancelledError  # Envoy resets the stream
        if not self.messages:
            return EOF
        self.sent += 1
        return self.messages.pop(0)

    async def write(self, raw: bytes) -> None:
        self.replies.append(pb.ProcessingResponse.FromString(raw))


def run(service: EndpointPickerService, messages: list, cancel_after: int | None = None):
    """Drive ``Process`` with ``messages`` (a callable in the list runs between two messages: a clock step).

    Returns the parsed replies. ``cancel_after``: Envoy resets the stream after that many messages.
    """
    context = Context(messages, cancel_after)

    async def go():
        try:
            await service.process(None, context)
        except asyncio.CancelledError:
            pass

    asyncio.run(go())
    return context.replies


def request_body(model: str = "m", **extra) -> bytes:
    return json.dumps({"model": model, "prompt": "x" * 400, **extra}).encode()


def picked_endpoint(reply: pb.ProcessingResponse) -> str:
    common = reply.request_body.response
    (option,) = common.header_mutation.set_headers
    assert option.header.key == protocol.DESTINATION_HEADER
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[protocol.DESTINATION_HEADER].string_value
    assert metadata == option.header.raw_value.decode()
    return metadata


def settled(service: EndpointPickerService) -> bool:
    return all(v == 0 for v in service.in_flight.values()) and all(service.balancer.load(b) == 0 for b in (A, B))


def response_count(service: EndpointPickerService) -> float:
    return sum(s.value for m in service.metrics._responses.collect() for s in m.samples if s.name.endswith("_total"))


# ---------------------------------------------------------------- request parsing


def test_parse_request_body():
    assert parse_request_body(b'{"model": "m", "prompt": "abcdefgh"}') == parse_request_body(b'{"model":"m","prompt":["abcd","efgh"]}')
    assert parse_request_body(b'{"model": "m", "prompt": "abcdefgh"}').est_prompt_tokens == 2
    info = parse_request_body(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]},'
                              b' {"role": "user", "content": "abcd"}]}')
    assert (info.model, info.est_prompt_tokens) == ("m", 3)
    assert parse_request_body(b'{"model": "m", "prompt": "abc", "prompt_tokens": 900}').est_prompt_tokens == 900
    assert parse_request_body(b"").model is None
    assert parse_request_body(b'{"prompt": "x"}').model is None
    for bad in (b"{", b"[1]", b'"s"', b'{"model": 3}', b"\xff\xfe"):
        with pytest.raises(BadRequest):
            parse_request_body(bad)


def test_subset_hint_forms():
    msg = with_subset(headers_msg({}), ["10.0.0.1:8000", "10.0.0.9:1"])
    assert protocol.subset_hint(msg) == ("10.0.0.1:8000", "10.0.0.9:1")
    msg = headers_msg({})
    assert protocol.subset_hint(msg) is None
    msg.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update({protocol.SUBSET_KEY: "a:1, b:2"})
    assert protocol.subset_hint(msg) == ("a:1", "b:2")


# ---------------------------------------------------------------- picking


def test_body_pick_sets_header_and_metadata_and_a_plain_answer_finishes_at_its_headers():
    service, _ = make_service()
    replies = run(service, [headers_msg({":method": "POST"}), body_msg(request_body()),
                            headers_msg({":status": "200", "content-type": "application/json"}, response=True)])
    assert replies[0].HasField("request_headers")
    assert picked_endpoint(replies[1]) in (A.address, B.address)
    # A non-streamed answer is finished at its headers and its body is not asked for.
    assert replies[2].mode_override.response_body_mode == 0  # NONE
    assert settled(service) and response_count(service) == 1


def test_bodyless_request_is_picked_on_its_headers():
    service, _ = make_service()
    replies = run(service, [headers_msg({":method": "GET"}, eos=True)])
    option = replies[0].request_headers.response.header_mutation.set_headers[0]
    assert option.header.raw_value.decode() in (A.address, B.address)
    assert settled(service)  # the stream ended without a response: finished as 499


def test_stream_feeds_first_token_once_and_finishes_at_end_of_stream():
    service, clock = make_service()
    seen = []
    real = service.balancer.on_first_token
    service.balancer.on_first_token = lambda *a, **k: (seen.append(a), real(*a, **k))  # type: ignore[method-assign]
    messages = [headers_msg({}), body_msg(request_body(stream=True)),
                headers_msg({":status": "200", "content-type": "text/event-stream"}, response=True)]
    messages += [lambda: setattr(clock, "t", clock.t + 0.25), body_msg(b"data: 1\n\n", eos=False, response=True), body_msg(b"data: 2\n\n", eos=False, response=True),
                 body_msg(b"data: [DONE]\n\n", eos=True, response=True)]
    replies = run(service, messages)
    assert len(replies) == 6
    assert len(seen) == 1 and seen[0][1] == pytest.approx(0.25)
    assert settled(service) and response_count(service) == 1


def test_subset_hint_restricts_the_pick():
    service, _ = make_service()
    for _ in range(20):
        replies = run(service, [with_subset(headers_msg({}), [B.address, "10.9.9.9:1"]), body_msg(request_body())])
        assert picked_endpoint(replies[1]) == B.address
    replies = run(service, [with_subset(headers_msg({}), ["10.9.9.9:1"]), body_msg(request_body())])
    assert replies[1].immediate_response.status.code == 503
    assert json.loads(replies[1].immediate_response.body)["error"]["type"] == "no_endpoint"
    assert settled(service)


@pytest.mark.parametrize(("body", "status", "failure"), [
    (b"{nope", 400, "bad_request"),
    (b'{"model": "other"}', 404, "unknown_model"),
    (json.dumps({"model": "m", "prompt": "x" * 5000}).encode(), 413, "body_too_large"),
])
def test_bad_requests_are_answered_by_the_picker(body, status, failure):
    service, _ = make_service(max_body_bytes=4096)
    replies = run(service, [headers_msg({}), body_msg(body)])
    immediate = replies[1].immediate_response
    assert immediate.status.code == status
    assert immediate.headers.set_headers[0].header.raw_value == b"application/json"
    assert json.loads(immediate.body)["error"]["code"] == status
    assert service.metrics.failures[failure]._value.get() == 1
    assert settled(service) and response_count(service) == 0


def test_body_in_chunks_over_the_limit_is_413():
    service, _ = make_service(max_body_bytes=4096)
    replies = run(service, [headers_msg({}), body_msg(b"{" + b" " * 3000, eos=False), body_msg(b" " * 3000, eos=False)])
    assert replies[2].immediate_response.status.code == 413


def test_no_eligible_backend_is_503():
    service, _ = make_service()
    for backend in (A, B):  # eject both: 3 consecutive connect failures each
        for _ in range(3):
            service.balancer.pick("m", 0, exclude=[b for b in (A, B) if b is not backend])
            service.balancer.on_finish(backend, "connect_error")
    replies = run(service, [headers_msg({}), body_msg(request_body())])
    assert replies[1].immediate_response.status.code == 503
    assert service.metrics.failures["no_backend"]._value.get() == 1


# ---------------------------------------------------------------- exactly-once feedback


@pytest.mark.parametrize("cancel_after", [2, 3, 4])
def test_reset_stream_finishes_once(cancel_after):
    """Envoy resets the stream after the pick, after the response headers, or after the first chunk."""
    service, _ = make_service()
    messages = [headers_msg({}), body_msg(request_body(stream=True)),
                headers_msg({":status": "200", "content-type": "text/event-stream"}, response=True),
                body_msg(b"data: 1\n\n", eos=False, response=True), body_msg(b"data: 2\n\n", eos=False, response=True)]
    run(service, messages, cancel_after=cancel_after)
    assert settled(service)
    assert response_count(service) == 1
    assert service.metrics.failures["stream_reset"]._value.get() == 1


def test_envoy_local_replies_are_classified():
    service, _ = make_service()
    run(service, [with_subset(headers_msg({}), [A.address]), body_msg(request_body()),
                  headers_msg({":status": "503", "content-type": "text/plain"}, response=True),
                  body_msg(b"upstream connect error or disconnect/reset before headers. reset reason: remote "
                           b"connection failure, transport failure reason: delayed connect error: Connection refused",
                           response=True)])
    run(service, [with_subset(headers_msg({}), [B.address]), body_msg(request_body()),
                  headers_msg({":status": "504"}, response=True), body_msg(b"upstream request timeout", response=True)])
    counters = service.balancer.counters
    assert counters["responses_connect_error_total"] == 1 and counters["responses_timeout_total"] == 1
    assert settled(service)


def test_saturation_body_is_kept_bounded_and_cools_the_backend():
    service, _ = make_service(error_body_bytes=64)
    run(service, [with_subset(headers_msg({}), [A.address]), body_msg(request_body()),
                  headers_msg({":status": "429", "retry-after": "2"}, response=True),
                  body_msg(b'{"error": "KV cache exhausted"}' + b" " * 10_000, response=True)])
    assert service.balancer.counters["responses_saturated_total"] == 1
    assert service.balancer.state(A).value == "cooling"
    assert settled(service)


# ---------------------------------------------------------------- config, bootstrap, CLI


def test_picker_config_is_strict():
    cfg = Config.from_toml('[picker]\nlisten = "0.0.0.0:9002"\nmax_streams = 10\n')
    assert cfg.picker.listen == "0.0.0.0:9002" and cfg.picker.max_streams == 10
    with pytest.raises(ConfigError, match="picker.listne"):
        Config.from_toml('[picker]\nlistne = "x"\n')
    with pytest.raises(ConfigError, match="listen must be HOST:PORT"):
        Config.from_toml('[picker]\nlisten = "9002"\n')
    assert split_listen("[::1]:9002") == ("::1", 9002)


def test_bootstrap_shapes():
    cfg = envoy_bootstrap("picker", 1, 2, picker_address="127.0.0.1:3")
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    pool = cfg["static_resources"]["clusters"][0]
    assert pool["type"] == "ORIGINAL_DST" and pool["original_dst_lb_config"]["use_http_header"]
    rr = envoy_bootstrap("least_request", 1, 2, endpoints=("127.0.0.1:5", "127.0.0.1:6"))
    assert rr["static_resources"]["clusters"][0]["lb_policy"] == "LEAST_REQUEST"
    with pytest.raises(ValueError):
        envoy_bootstrap("random", 1, 2)


def test_cli_usage_errors(capsys):
    assert main(["picker"]) == EX_USAGE
    assert "no backends" in capsys.readouterr().err
    assert main(["--backend", "http://127.0.0.1:1", "picker", "--listen", "nowhere"]) == EX_USAGE
    assert "--listen must be HOST:PORT" in capsys.readouterr().err


def test_model_header_fast_path_picks_on_headers_and_skips_the_body():
    service, _ = make_service()
    replies = run(service, [headers_msg({":method": "POST", "x-gateway-model-name": "m", "content-length": "4000"}),
                            headers_msg({":status": "200", "content-type": "application/json"}, response=True)])
    common = replies[0].request_headers.response
    assert common.header_mutation.set_headers[0].header.raw_value.decode() in (A.address, B.address)
    assert replies[0].mode_override.request_body_mode == 0  # NONE: Envoy does not send the body
    assert replies[0].mode_override.response_header_mode == 1  # SEND: the response is still watched
    assert settled(service) and response_count(service) == 1
    # The header names an unknown model, or the declared size is over the limit: answered at once.
    replies = run(service, [headers_msg({"x-gateway-model-name": "nope", "content-length": "10"})])
    assert replies[0].immediate_response.status.code == 404
    service, _ = make_service(max_body_bytes=4096)
    replies = run(service, [headers_msg({"x-gateway-model-name": "m", "content-length": "5000"})])
    assert replies[0].immediate_response.status.code == 413
    # Turned off: the body is read.
    service, _ = make_service(model_header="")
    replies = run(service, [headers_msg({"x-gateway-model-name": "m"}), body_msg(request_body())])
    assert replies[0].HasField("request_headers") and not replies[0].request_headers.HasField("response")
    assert picked_endpoint(replies[1])


# ---------------------------------------------------------------- DNS discovery


def test_dns_backends_follow_the_answers_and_survive_failures():
    from llmdiag.picker.discovery import DnsBackends

    answers: list = [["10.0.0.2", "10.0.0.1", "10.0.0.1"], OSError("Name or service not known"), [],
                     ["fd00::7"]]

    async def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("pool.ns.svc", 8000)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    dns = DnsBackends("pool.ns.svc:8000", models=("m",), resolve=resolve)

    async def go():
        assert await dns.poll()
        assert [b.name for b in dns.backends] == ["10.0.0.1:8000", "10.0.0.2:8000"]
        assert dns.backends[0].models == ("m",) and dns.backends[0].url == "http://10.0.0.1:8000"
        assert not await dns.poll()  # resolution failed: the last set stays
        assert len(dns.backends) == 2 and dns.errors_total == 1
        assert await dns.poll() and dns.backends == []  # an empty answer is the truth
        assert await dns.poll() and dns.backends[0].url == "http://[fd00::7]:8000"

    asyncio.run(go())


def test_picker_server_applies_discovered_backends_to_the_balancer():
    from llmdiag.picker.discovery import DnsBackends
    from llmdiag.picker.server import PickerServer

    answers = [["10.1.0.1"], ["10.1.0.1", "10.1.0.2"]]

    async def resolve(host: str, port: int) -> list[str]:
        return answers[0] if len(answers) == 1 else answers.pop(0)

    async def go():
        clock = Clock()
        service = EndpointPickerService(Balancer([A], clock=clock, rng=random.Random(1)), PickerConfig(probes=False),
                                        clock=clock)
        dns = DnsBackends("pool:8000", models=("m",), interval=0.01, resolve=resolve)
        server = PickerServer(service, "127.0.0.1:0", "", discovery=dns)
        await server.start()
        try:
            assert {b.name for b in service.balancer.backends} == {"a", "10.1.0.1:8000"}
            for _ in range(100):
                if len(service.balancer.backends) == 3:
                    break
                await asyncio.sleep(0.01)
            assert {b.name for b in service.balancer.backends} == {"a", "10.1.0.1:8000", "10.1.0.2:8000"}
            # The new backend is routable: a subset hint naming it picks it.
            reply = run_sync_exchange(service, [with_subset(headers_msg({}), ["10.1.0.2:8000"]), body_msg(request_body())])
            assert picked_endpoint(reply[1]) == "10.1.0.2:8000"
        finally:
            await server.stop()

    asyncio.run(go())


def run_sync_exchange(service: EndpointPickerService, messages: list) -> list:
    """Handle messages without the event loop (inside a running loop)."""
    from llmdiag.picker.service import _Exchange

    exchange = _Exchange(service)
    replies = [pb.ProcessingResponse.FromString(exchange.handle(m)) for m in messages]
    exchange.close()
    return replies


def test_cli_discover_needs_host_and_port(capsys):
    assert main(["picker", "--discover", "pool.ns.svc"]) == EX_USAGE
    assert "--discover must be HOST:PORT" in capsys.readouterr().err


def test_the_documented_bootstrap_is_the_tested_one():
    """docs/integrations/envoy.md shows exactly what envoy_bootstrap() gives the tests and the benchmark."""
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations" / "envoy.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert block is not None
    assert yaml.safe_load(block.group(1)) == envoy_bootstrap("picker", 8080, 9901, picker_address="127.0.0.1:9002")
