"""The Endpoint Picker Protocol on Envoy's ext_proc messages (xds-protos stubs).

Per request the picker tells the proxy the chosen endpoint twice, as the
Gateway API Inference Extension asks: the request header
``x-gateway-destination-endpoint: ip:port`` (what an ``ORIGINAL_DST`` cluster
with ``use_http_header: true`` routes on) and the same value in dynamic
metadata ``{"envoy.lb": {"x-gateway-destination-endpoint": "ip:port"}}``
(Envoy keeps it only with ``metadata_options.receiving_namespaces.untyped:
["envoy.lb"]``). The proxy may restrict the choice with a subset hint in the
filter metadata ``envoy.lb.subset_hint`` (key
``x-gateway-destination-endpoint-subset``, a list of ``ip:port``).

Replies are serialised once and reused: a pick reply depends only on the
endpoint, so each backend's bytes are built on first use. The servicer is
registered with an identity serializer and yields these bytes directly,
which keeps protobuf work off the per-request path.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

__all__ = [
    "DESTINATION_HEADER",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "ReplyCache",
    "header_value",
    "immediate_reply",
    "subset_hint",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _serialize(response: pb.ProcessingResponse) -> bytes:
    return response.SerializeToString()


#: "Continue" replies, one per message kind: nothing to change.
CONTINUE_REQUEST_HEADERS = _serialize(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
CONTINUE_REQUEST_BODY = _serialize(pb.ProcessingResponse(request_body=pb.BodyResponse()))
CONTINUE_RESPONSE_HEADERS = _serialize(pb.ProcessingResponse(response_headers=pb.HeadersResponse()))
CONTINUE_RESPONSE_BODY = _serialize(pb.ProcessingResponse(response_body=pb.BodyResponse()))
CONTINUE_REQUEST_TRAILERS = _serialize(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
CONTINUE_RESPONSE_TRAILERS = _serialize(pb.ProcessingResponse(response_trailers=pb.TrailersResponse()))
#: Reply to response headers that stops sending the response body (needs ``allow_mode_override: true``;
#: without it Envoy ignores the override and keeps sending chunks, which stays correct, only slower).
SKIP_RESPONSE_BODY = _serialize(pb.ProcessingResponse(
    response_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        response_body_mode=processing_mode_pb2.ProcessingMode.NONE,
        response_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
    ),
))


#: Where a pick happens, which decides the reply's shape.
ON_BODY = 0  # the buffered body: a request_body reply
ON_HEADERS = 1  # the headers of a request without a body: a request_headers reply
ON_HEADERS_SKIP_BODY = 2  # the headers (model from a header): a request_headers reply that skips the body


class ReplyCache:
    """Serialised pick replies per endpoint and place of the pick (see ``ON_*``).

    The reply sets the destination header (overwriting any the client sent: a
    client must not choose the endpoint) and the ``envoy.lb`` dynamic metadata.
    The cache is bounded by the backend set.
    """

    def __init__(self) -> None:
        self._replies: tuple[dict[str, bytes], ...] = ({}, {}, {})

    def pick(self, address: str, where: int) -> bytes:
        cache = self._replies[where]
        reply = cache.get(address)
        if reply is None:
            reply = cache[address] = _pick_reply(address, where)
        return reply

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget endpoints no longer in the backend set."""
        keep = set(addresses)
        for cache in self._replies:
            for address in [a for a in cache if a not in keep]:
                del cache[address]


def _pick_reply(address: str, where: int) -> bytes:
    mutation = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=address.encode()),
        append_action=_OVERWRITE,
    )])
    common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=False)
    response = pb.ProcessingResponse()
    if where == ON_BODY:
        response.request_body.response.CopyFrom(common)
    else:
        response.request_headers.response.CopyFrom(common)
    if where == ON_HEADERS_SKIP_BODY:
        # The rest of the exchange without the request body; the response is watched as configured.
        response.mode_override.CopyFrom(processing_mode_pb2.ProcessingMode(
            request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
            request_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
            response_header_mode=processing_mode_pb2.ProcessingMode.SEND,
            response_body_mode=processing_mode_pb2.ProcessingMode.STREAMED,
            response_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
        ))
    response.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: address}})
    return _serialize(response)


def immediate_reply(status: int, error: str, message: str, details: str) -> bytes:
    """An immediate JSON answer to the client (the request goes nowhere): ``{"error": {...}}``.

    ``details`` is Envoy's response code details (``%RESPONSE_CODE_DETAILS%`` in access logs).
    """
    body = json.dumps({"error": {"type": error, "message": message, "code": status}}).encode()
    headers = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"), append_action=_OVERWRITE,
    )])
    response = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=headers, body=body, details=details,
    ))
    return _serialize(response)


def header_value(headers: pb.HttpHeaders, name: str) -> str | None:
    """The first value of header ``name`` (lower case) in an ext_proc header map; Envoy sends ``raw_value``."""
    for header in headers.headers.headers:
        if header.key == name:
            return header.raw_value.decode("latin-1") if header.raw_value else header.value
    return None


def subset_hint(request: pb.ProcessingRequest) -> tuple[str, ...] | None:
    """The proxy's subset hint (endpoints the pick must come from), ``None`` when it sent none."""
    if not request.HasField("metadata_context"):
        return None
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return tuple(v.string_value for v in value.list_value.values if v.HasField("string_value"))
    if value.HasField("string_value"):  # tolerated: one comma-separated string
        return tuple(s.strip() for s in value.string_value.split(",") if s.strip())
    return ()
