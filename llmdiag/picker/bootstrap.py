"""Envoy bootstraps for the picker and for the plain policies it is compared with.

:func:`envoy_bootstrap` returns an Envoy v3 bootstrap as plain data (write it
as JSON; Envoy reads JSON or YAML) for one of three data paths:

- ``"picker"``: the ext_proc filter asks the picker at ``picker_address``;
  the pool is an ``ORIGINAL_DST`` cluster routed by the
  ``x-gateway-destination-endpoint`` header (the Endpoint Picker Protocol);
- ``"round_robin"`` / ``"least_request"``: Envoy's own balancing over the
  static ``endpoints``, no picker (the baselines of ``bench/bench_picker.py``).

The picker's processing mode is the one :mod:`llmdiag.picker.service`
expects (request body BUFFERED, response headers SEND, response body
STREAMED with ``allow_mode_override`` so non-streamed answers skip it).
``failure_mode_allow: false``: with the picker down Envoy answers 500 rather
than sending requests nowhere. This is the configuration the integration tests
and the benchmark run; docs/integrations/envoy.md shows it as YAML.
"""

from __future__ import annotations

from typing import Any

__all__ = ["POLICIES", "envoy_bootstrap"]

POLICIES = ("picker", "round_robin", "least_request")


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def envoy_bootstrap(
    policy: str,
    listen_port: int,
    admin_port: int,
    *,
    picker_address: str = "",
    endpoints: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    route_timeout_seconds: float = 60.0,
    message_timeout_seconds: float = 5.0,
    subset_hint_header: bool = False,
    picker_tls: bool = False,
    access_log: str = "",
) -> dict[str, Any]:
    """An Envoy bootstrap: listener on ``host:listen_port``, admin on ``host:admin_port``.

    ``subset_hint_header`` (tests): copy a request header
    ``x-gateway-destination-endpoint-subset`` (comma-separated ``ip:port``)
    into the ``envoy.lb.subset_hint`` filter metadata, the way an inference
    gateway passes its subset hint, and forward that namespace to the picker.
    ``picker_tls``: talk TLS to the picker without verifying its certificate,
    as the Kubernetes inference gateways do with their picker by default.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    filters: list[dict[str, Any]] = []
    clusters: list[dict[str, Any]] = []
    if policy == "picker":
        if not picker_address:
            raise ValueError("the picker policy needs picker_address")
        if subset_hint_header:
            filters.append({
                "name": "envoy.filters.http.header_to_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                    "request_rules": [{
                        "header": "x-gateway-destination-endpoint-subset",
                        "on_header_present": {"metadata_namespace": "envoy.lb.subset_hint",
                                              "key": "x-gateway-destination-endpoint-subset", "type": "STRING"},
                        "remove": True,
                    }],
                },
            })
        ext_proc: dict[str, Any] = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "llmdiag_picker"}, "timeout": "10s"},
            "failure_mode_allow": False,
            "message_timeout": f"{message_timeout_seconds}s",
            "allow_mode_override": True,
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "STREAMED",
                "response_trailer_mode": "SKIP",
            },
            "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
        }
        if subset_hint_header:
            ext_proc["metadata_options"]["forwarding_namespaces"] = {"untyped": ["envoy.lb.subset_hint"]}
        filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc})
        clusters.append({
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"},
        })
        phost, pport = _split(picker_address)
        clusters.append({
            "name": "llmdiag_picker",
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                },
            },
            "load_assignment": {"cluster_name": "llmdiag_picker", "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(phost, pport)}}]}]},
        })
        if picker_tls:
            clusters[-1]["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"], "validation_context": {}}}}
    else:
        if not endpoints:
            raise ValueError(f"the {policy} policy needs endpoints")
        clusters.append({
            "name": "pool",
            "type": "STATIC",
            "lb_policy": policy.upper(),
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(*_split(e))}} for e in endpoints]}]},
        })
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gw",
        "route_config": {"name": "r", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": f"{route_timeout_seconds}s"}}]}]},
        "http_filters": filters,
    }
    if access_log:
        hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": access_log,
            "log_format": {"text_format_source": {"inline_string":
                "%REQ(:PATH)% code=%RESPONSE_CODE% flags=%RESPONSE_FLAGS% details=%RESPONSE_CODE_DETAILS% "
                "upstream=%UPSTREAM_HOST% dur=%DURATION%ms\n"}},
        }}]
    return {
        "admin": {"address": _address(host, admin_port)},
        "static_resources": {
            "listeners": [{"name": "gw", "address": _address(host, listen_port), "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
    }
