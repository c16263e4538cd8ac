"""The data model's JSON contracts (SPEC 3.2-3.4) round-trip and reject bad input."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from llmdiag.model import (
    NA,
    Backend,
    BackendPenalty,
    BackendState,
    BackendURLError,
    CollectorState,
    CollectorStatus,
    Diagnosis,
    Distribution,
    Evidence,
    Labelled,
    PenaltiesDocument,
    Reason,
    Sample,
    Scope,
    Severity,
    Snapshot,
    SnapshotError,
    combine_penalties,
    decode_value,
    encode_value,
    label_key,
    parse_label_key,
    read_snapshots,
    write_snapshots,
)


def test_label_key_sorted_and_parsed_back() -> None:
    key = label_key(direction="received", code="CANCEL")
    assert key == "code=CANCEL,direction=received"
    assert parse_label_key(key) == {"code": "CANCEL", "direction": "received"}
    assert parse_label_key("") == {}
    with pytest.raises(ValueError):
        label_key(reason="a,b")
    with pytest.raises(ValueError):
        parse_label_key("novalue")


def test_spec_encoding_examples() -> None:
    rst = Labelled()
    rst.add(5, code="CANCEL", direction="received")
    assert encode_value(rst) == {"code=CANCEL,direction=received": 5}
    ttft = Distribution(p50=0.31, p99=2.4, ewma=0.52, count=118)
    assert encode_value(ttft) == {"p50": 0.31, "p99": 2.4, "ewma": 0.52, "count": 118}
    assert decode_value({"p50": 0.31, "p99": 2.4, "ewma": 0.52, "count": 118}) == ttft
    assert decode_value({"code=CANCEL,direction=received": 5}) == rst
    assert encode_value(None) is None
    # NA and NaN are "the source cannot give it": null, never a made-up zero.
    assert encode_value(NA) is None
    assert encode_value(float("nan")) is None
    assert encode_value(Distribution(p50=None, p99=math.inf, ewma=0.1, count=3)) == {
        "p50": None, "p99": None, "ewma": 0.1, "count": 3}


def test_decode_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        decode_value("12")
    with pytest.raises(ValueError):
        decode_value(True)
    with pytest.raises(ValueError):
        decode_value({"noequals": 1})
    with pytest.raises(ValueError):
        decode_value({"a=b": "x"})


def _snapshot() -> Snapshot:
    snap = Snapshot(ts=1733140000.0, hostname="gpu-node-7")
    rst = Labelled()
    rst.add(5, code="CANCEL", direction="received")
    snap.extend([
        Sample(Scope.HOST, "", "psi_io_full_avg10", 0.02),
        Sample(Scope.HOST, "", "sockstat_tcp_tw", 812),
        Sample(Scope.DESTINATION, "10.0.0.7:8000", "timewait_sockets", 800),
        Sample(Scope.DESTINATION, "10.0.0.7:8000", "port_exhaustion_eta_seconds", None),
        Sample(Scope.BACKEND, "vllm-0", "requests_waiting", 87),
        Sample(Scope.BACKEND, "vllm-0", "kv_cache_usage", 0.987),
        Sample(Scope.BACKEND, "vllm-0", "ttft_seconds", Distribution(0.31, 2.4, 0.52, 118)),
        Sample(Scope.BACKEND, "vllm-0", "h2_rst_stream_total", rst),
        Sample(Scope.ENGINE, "vllm-0", "kv_cache_usage", 0.987, engine="1"),
        Sample(Scope.ENGINE, "vllm-0", "kv_cache_usage", 0.41, engine="0"),
        Sample(Scope.GPU, "0", "gpu_utilization", 0.93),
        Sample(Scope.GPU, "10", "gpu_utilization", 0.1),
        Sample(Scope.GPU, "2", "gpu_utilization", 0.2),
    ])
    snap.collectors["engine"] = CollectorStatus(CollectorState.OK, None, 1733140000.0)
    snap.collectors["gpu"] = CollectorStatus(CollectorState.UNAVAILABLE, "NVML library not found")
    return snap


def test_snapshot_json_layout_matches_spec() -> None:
    doc = json.loads(_snapshot().dumps())
    assert doc["schema"] == "llmdiag.snapshot/v1"
    assert set(doc) >= {"ts", "host", "backends", "gpus", "collectors"}
    assert doc["host"]["destinations"]["10.0.0.7:8000"] == {"port_exhaustion_eta_seconds": None, "timewait_sockets": 800}
    backend = doc["backends"]["vllm-0"]
    assert backend["h2_rst_stream_total"] == {"code=CANCEL,direction=received": 5}
    assert backend["ttft_seconds"] == {"p50": 0.31, "p99": 2.4, "ewma": 0.52, "count": 118}
    assert backend["engines"] == {"0": {"kv_cache_usage": 0.41}, "1": {"kv_cache_usage": 0.987}}
    assert list(doc["gpus"]) == ["0", "2", "10"]  # numeric order, not string order
    assert doc["collectors"]["gpu"] == {"status": "unavailable", "reason": "NVML library not found",
                                        "last_ok_ts": None, "errors_total": 0}


def test_snapshot_round_trip() -> None:
    snap = _snapshot()
    back = Snapshot.loads(snap.dumps())
    assert back.to_json() == snap.to_json()
    assert sorted(map(repr, back.samples())) == sorted(map(repr, snap.samples()))


@pytest.mark.parametrize("text, message", [
    ("[]", "JSON object"),
    ('{"schema": "llmdiag.snapshot/v0", "ts": 1}', "unknown snapshot schema"),
    ('{"schema": "llmdiag.snapshot/v1"}', "no finite numeric 'ts'"),
    ('{"schema": "llmdiag.snapshot/v1", "ts": 1, "backends": {"a": {"x": "high"}}}', "backends[a].x"),
    ('{"schema": "llmdiag.snapshot/v1", "ts": 1, "collectors": {"a": {"status": "fine"}}}', "bad collector status"),
    ("{not json", "not JSON"),
])
def test_snapshot_rejects_bad_documents(text: str, message: str) -> None:
    with pytest.raises(SnapshotError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Snapshot.loads(text)


def test_reserved_keys_are_not_signal_names() -> None:
    with pytest.raises(ValueError):
        Sample(Scope.BACKEND, "a", "engines", 1)
    with pytest.raises(ValueError):
        Sample(Scope.ENGINE, "a", "kv_cache_usage", 1)  # engine label missing


@pytest.mark.parametrize("name", ["rec.jsonl", "rec.jsonl.gz"])
def test_jsonl_recording_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    snaps = [_snapshot(), Snapshot(ts=1733140001.0, hostname="gpu-node-7")]
    assert write_snapshots(path, snaps) == 2
    if name.endswith(".gz"):
        with gzip.open(path, "rt") as fh:
            assert len(fh.readlines()) == 2
    back = list(read_snapshots(path))
    assert [s.to_json() for s in back] == [s.to_json() for s in snaps]


def test_recording_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_snapshot().dumps() + "\n{oops\n")
    reader = read_snapshots(path)
    next(reader)
    with pytest.raises(SnapshotError, match=r"bad.jsonl:2"):
        next(reader)


def test_backend_urls() -> None:
    b = Backend.from_url("http://10.0.0.7:8000", engine="vllm", models=("llama",))
    assert (b.name, b.scheme, b.host, b.port, b.address) == ("10.0.0.7:8000", "http", "10.0.0.7", 8000, "10.0.0.7:8000")
    assert Backend.from_url("grpc://[::1]:8001").address == "[::1]:8001"


def test_metrics_url_is_validated_and_serialised_only_when_set() -> None:
    plain = Backend.from_url("http://10.0.0.7:8000")
    assert plain.metrics_url is None and "metrics_url" not in plain.to_json()
    triton = Backend.from_url("grpc://10.0.0.7:8001", name="triton", metrics_url="http://10.0.0.7:8002/metrics")
    assert triton.to_json()["metrics_url"] == "http://10.0.0.7:8002/metrics"
    assert Backend.from_json(json.loads(json.dumps(triton.to_json()))) == triton
    assert Backend.from_json(plain.to_json()).metrics_url is None
    for bad in ("grpc://h:8002", "h:8002/metrics", "http:///metrics", "https://h:99999/metrics", "http://h:1/m#x"):
        with pytest.raises(BackendURLError, match="bad metrics URL"):
            Backend.from_url("grpc://h:8001", metrics_url=bad)


def test_ipv6_backends_are_named_as_everything_else_names_them() -> None:
    import socket

    from llmdiag.collectors.sockdiag import format_endpoint
    from llmdiag.collectors.timewait import backend_destination

    b = Backend.from_url("http://[::1]:8201")
    kernel = format_endpoint(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, "::1"), 8201)
    assert b.name == b.address == backend_destination(b) == kernel == "[::1]:8201"  # never "::1:8201"
    assert Backend.from_json(b.to_json()) == b
    for bad in ("ftp://x:1", "http://:80", "grpc://host", "http://h:1/v1", "http://h:99999"):
        with pytest.raises(BackendURLError):
            Backend.from_url(bad)
    with pytest.raises(ValueError, match="unknown engine"):
        Backend.from_url("http://h:1", engine="llamacpp")


def test_combine_penalties() -> None:
    assert combine_penalties([]) == 0.0
    assert combine_penalties([0.5, 0.5]) == pytest.approx(0.75)
    assert combine_penalties([1.0, 0.2]) == 1.0
    with pytest.raises(ValueError):
        combine_penalties([1.5])


def test_diagnosis_and_penalties_round_trip() -> None:
    d = Diagnosis(
        kind="kv_cache_saturation", backend="vllm-0", severity=Severity.WARNING, confidence=0.9, since=1733139990.0,
        summary="KV cache 98.7 % for 12 s with 87 waiting",
        evidence=(Evidence("kv_cache_usage", 0.987, 0.85, 3.0), Evidence("requests_waiting", 87, 30, 3.0)),
        remediation="Route long prompts elsewhere; lower max_num_seqs; scale out.", penalty=0.25,
    )
    assert Diagnosis.from_json(json.loads(json.dumps(d.to_json()))) == d
    doc = PenaltiesDocument(ts=1733140000.0, host="gpu-node-7", ttl_seconds=5, backends=(
        BackendPenalty("vllm-0", "10.0.0.7:8000", 63.5, 0.31, 64, BackendState.DEGRADED, (Reason.from_diagnosis(d),)),
    ))
    data = json.loads(doc.dumps())
    assert data["schema"] == "llmdiag.penalties/v1"
    assert data["backends"][0]["reasons"][0] == {"kind": "kv_cache_saturation", "severity": "warning",
                                                  "penalty": 0.25, "summary": d.summary}
    assert PenaltiesDocument.from_json(data) == doc
    assert doc.is_fresh(1733140004.0) and not doc.is_fresh(1733140006.0)
    with pytest.raises(ValueError):
        Diagnosis.from_json({**d.to_json(), "kind": "bad_kind"})
    with pytest.raises(ValueError, match="weight_percent"):
        BackendPenalty("a", "h:1", 50.0, 0.5, 50.5, BackendState.HEALTHY)  # type: ignore[arg-type]


def test_penalties_entry_labels_are_serialised_only_when_known() -> None:
    plain = BackendPenalty("vllm-0", "10.0.0.7:8000", 100.0, 0.0, 100, BackendState.HEALTHY)
    assert list(plain.to_json()) == ["name", "address", "score", "penalty", "weight_percent", "state", "reasons"]
    assert BackendPenalty.from_json(plain.to_json()) == plain and BackendPenalty.from_json(plain.to_json()).labels == {}
    pod = {"pod": "vllm-0-7d9f", "namespace": "llm", "container": "vllm", "node": "gpu-node-7"}
    labelled = BackendPenalty("vllm-0", "10.0.0.7:8000", 100.0, 0.0, 100, BackendState.HEALTHY, labels=pod)
    data = json.loads(PenaltiesDocument(ts=1733140000.0, host="gpu-node-7", backends=(labelled, plain)).dumps())
    assert data["backends"][0]["labels"] == {"container": "vllm", "namespace": "llm", "node": "gpu-node-7", "pod": "vllm-0-7d9f"}
    assert "labels" not in data["backends"][1]
    back = PenaltiesDocument.from_json(data)
    assert back.backends[0] == labelled and back.backends[0].labels == pod and back.backends[1].labels == {}
    assert labelled != plain and hash(labelled) == hash(plain)  # labels take part in equality, not in the hash


def test_na_behaves_as_nan_and_prints_na() -> None:
    assert str(NA) == "N/A" and f"{NA:>6.1f}" == "   N/A"
    assert math.isnan(NA + 1) and not NA and NA == NA and NA != 0


@pytest.mark.parametrize("value", [1e400, -1e400, 10**400, float("nan")])
def test_non_finite_and_huge_numbers_decode_as_na(value: float) -> None:
    # JSON can carry them (1e400 parses to inf); they are not measurements and must not
    # reach an analyzer that would raise OverflowError on float() or int().
    assert decode_value(value) is None
    assert decode_value({"p50": value, "p99": 1.0}) == Distribution(p50=None, p99=1.0)


@pytest.mark.parametrize("doc, where", [
    ({"host": []}, "host: expected an object"),
    ({"host": {"destinations": []}}, "host.destinations: expected an object"),
    ({"backends": {"a": "x"}}, r"backends\[a\]: expected an object"),
    ({"backends": {"a": {"engines": []}}}, r"backends\[a\].engines: expected an object"),
    ({"collectors": {"engine": "ok"}}, r"collectors\[engine\]: expected an object"),
    ({"ts": float("nan")}, "no finite numeric 'ts'"),
    ({"ts": True}, "no finite numeric 'ts'"),
])
def test_malformed_structure_is_a_snapshot_error(doc: dict, where: str) -> None:
    with pytest.raises(SnapshotError, match=where):
        Snapshot.from_json({"schema": "llmdiag.snapshot/v1", "ts": 1.0, **doc})


def test_binary_or_broken_gzip_recordings_are_snapshot_errors(tmp_path: Path) -> None:
    binary = tmp_path / "rec.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(SnapshotError, match="not a text recording"):
        list(read_snapshots(binary))
    broken = tmp_path / "rec.jsonl.gz"
    broken.write_bytes(gzip.compress(_snapshot().dumps().encode() + b"\n")[:-12])
    with pytest.raises(SnapshotError, match="broken gzip"):
        list(read_snapshots(broken))


def test_one_penalty_combines_to_itself() -> None:
    assert combine_penalties([0.2]) == 0.2
    assert combine_penalties([0.1, 0.1]) == 0.19
