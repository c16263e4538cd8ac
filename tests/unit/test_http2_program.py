"""http2 collector without root: the program text, /proc matching on a recorded tree, signal assembly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmdiag.bpf.loader import render
from llmdiag.collectors.h2_kernel import ConnectionCounters, code_counts, code_name, program_defines
from llmdiag.collectors.h2_procnet import backend_sockets, parse_proc_net_tcp, scan_pid_fds
from llmdiag.collectors.http2 import _backend_signals
from llmdiag.config import Config, ConfigError
from llmdiag.config.http2 import Http2Config

# -- the program ----------------------------------------------------------------


def test_render_with_the_collector_defines() -> None:
    config = Http2Config(stall_seconds=0.5, max_connections=1024, steps_per_run=6, max_runs=20)
    text = render("http2_frames", program_defines(config))
    assert "#define H2_STALL_NS 500000000" in text
    assert "#define H2_MAX_CONNS 1024" in text
    assert "#define H2_STEPS_PER_CALL 6" in text
    assert "#define H2_MAX_ROUNDS 20" in text
    assert "begin http2_frames.h" in text and "begin common.h" in text
    assert '#include "http2_frames.h"' not in text
    for syscall in ("write", "writev", "sendto", "sendmsg", "read", "readv", "recvfrom", "recvmsg"):
        assert f"TRACEPOINT_PROBE(syscalls, sys_enter_{syscall})" in text
        assert f"TRACEPOINT_PROBE(syscalls, sys_exit_{syscall})" in text
    assert "int h2_walk(void *ctx)" in text  # the tail-called walker the collector installs


def test_preface_constant_in_the_program_is_the_rfc_preface() -> None:
    # preface_byte() spells the preface as three little-endian words; check them here.
    text = render("http2_frames")
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    for i in range(3):
        word = int.from_bytes(preface[8 * i:8 * i + 8], "little")
        assert f"0x{word:016x}ull" in text.lower()


def test_event_struct_mirrors_the_header() -> None:
    from llmdiag.collectors.h2_kernel import _Event

    header = render("http2_frames")
    block = header[header.index("struct h2_event {"):]
    block = block[:block.index("};")]
    fields = [line.split()[1].rstrip(";") for line in block.splitlines()[1:] if line.strip().startswith("__u")]
    assert fields == [name for name, _ in _Event._fields_]


def test_code_names_follow_rfc_9113() -> None:
    assert code_name(0) == "NO_ERROR" and code_name(8) == "CANCEL" and code_name(13) == "HTTP_1_1_REQUIRED"
    assert code_name(14) == "OTHER" and code_name(0xDEAD) == "OTHER"
    assert code_counts([0] * 8 + [5] + [0] * 6 + [2]) == {"CANCEL": 5, "OTHER": 2}


@pytest.mark.parametrize("bad", [
    {"stall_seconds": 0}, {"steps_per_run": 9}, {"max_runs": 34}, {"max_connections": 1}, {"refresh_seconds": 0},
])
def test_config_rejects_bad_ranges(bad: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        Config.from_data({"http2": bad})


def test_config_section_defaults() -> None:
    assert Config().http2 == Http2Config()
    assert Config.from_data({"http2": {"stall_seconds": 1.5}}).http2.stall_seconds == 1.5


# -- /proc matching on a recorded tree --------------------------------------------

# /proc/net/tcp and tcp6 as recorded on the development machine with a gRPC
# server listening on 127.0.0.1:50051 (0xC383), one accepted connection from
# port 50910 (0xC6DE), its client side, a TIME_WAIT (inode 0) and an unrelated
# listener on 8000 (0x1F40).
NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:C383 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 66180 1 000000003e4f8d43 100 0 0 10 0
   1: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1061 1 00000000b2764734 100 0 0 10 0
   2: 0100007F:C383 0100007F:C6DE 01 00000000:00000000 00:00000000 00000000     0        0 70001 1 00000000aaaa0000 20 4 30 10 -1
   3: 0100007F:C6DE 0100007F:C383 01 00000000:00000000 00:00000000 00000000     0        0 70002 1 00000000aaaa0001 20 4 30 10 -1
   4: 0100007F:C383 0100007F:C6E0 06 00000000:00000000 03:000015D8 00000000     0        0 0 3 00000000e65a70f8
   5: truncated row
"""
NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:C383 0000000000000000FFFF00000100007F:D000 01 00000000:00000000 00:00000000 00000000     0        0 70003 1 00000000bbbb0000 20 4 30 10 -1
"""


def _tree(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text(NET_TCP)
    (proc / "net" / "tcp6").write_text(NET_TCP6)
    fds = {
        100: {3: "socket:[66180]", 7: "socket:[70001]", 8: "socket:[70003]", 9: "pipe:[5]", 10: "/dev/null"},
        200: {4: "socket:[70002]"},  # the client: its socket's local port is ephemeral
        300: {5: "socket:[1061]"},   # another server on another port
    }
    for pid, table in fds.items():
        (proc / str(pid) / "fd").mkdir(parents=True)
        for fd, target in table.items():
            os.symlink(target, proc / str(pid) / "fd" / str(fd))
    (proc / "self").mkdir()  # not a pid
    return proc


def test_backend_sockets_matches_listener_pid_and_its_connections(tmp_path: Path) -> None:
    found = backend_sockets([50051], _tree(tmp_path))
    assert found.pid_ports == {100: (50051,)}
    assert found.connections == {(100, 7): 50051, (100, 8): 50051}  # v4 and v4-mapped v6


def test_backend_sockets_without_a_listener_finds_nothing(tmp_path: Path) -> None:
    found = backend_sockets([50052], _tree(tmp_path))
    assert found.pid_ports == {} and found.connections == {}


def test_missing_proc_files_mean_nothing_found(tmp_path: Path) -> None:
    assert backend_sockets([50051], tmp_path / "nothing").pid_ports == {}
    assert scan_pid_fds(tmp_path, 12345) == {}


def test_parse_proc_net_tcp_skips_malformed_and_inode_zero_rows() -> None:
    rows = parse_proc_net_tcp(NET_TCP)
    assert [r.inode for r in rows] == [66180, 1061, 70001, 70002]
    assert rows[0].listening and rows[0].local_port == 50051
    assert rows[2].remote_port == 50910 and rows[2].state == 1


# -- samples from counters ------------------------------------------------------------


def _counters(**values: object) -> dict:
    base = {k: 0 for k in ("frames", "data_frames", "data_bytes", "headers", "streams_opened", "streams_closed",
                           "end_stream", "settings", "pings", "window_updates", "stalls", "send_eagain",
                           "desyncs", "truncated")}
    base.update({"rst_stream": [0] * 16, "goaway": [0] * 16})
    base.update(values)
    return base


def test_backend_signals_use_spec_label_encoding() -> None:
    rst_received = [0] * 16
    rst_received[8] = 5
    rst_sent = [0] * 16
    rst_sent[0] = 2
    goaway_sent = [0] * 16
    goaway_sent[0] = 1
    stats = {
        (50051, "received"): _counters(streams_opened=7, streams_closed=5, rst_stream=rst_received, settings=1),
        (50051, "sent"): _counters(streams_closed=2, stalls=1, goaway=goaway_sent, rst_stream=rst_sent),
        (8000, "received"): _counters(streams_opened=99),
    }
    conns = [ConnectionCounters(1, 7, 50051, True, 1, 5, 0, 0, 0, 0),
             ConnectionCounters(1, 8, 50051, False, 0, 0, 0, 0, 0, 0),
             ConnectionCounters(2, 3, 8000, True, 0, 0, 0, 0, 0, 0)]
    signals = _backend_signals(50051, stats, conns)
    assert signals["h2_streams_opened_total"] == 7
    assert signals["h2_streams_closed_total"] == 7
    assert signals["h2_rst_stream_total"] == {"code=CANCEL,direction=received": 5, "code=NO_ERROR,direction=sent": 2}
    assert signals["h2_goaway_total"] == {"code=NO_ERROR,direction=sent": 1}
    assert signals["h2_flow_control_stalls_total"] == 1
    assert signals["grpc_connections"] == 1  # the unconfirmed one is not HTTP/2 (yet)
    assert signals["h2_settings_total"] == {"direction=received": 1, "direction=sent": 0}


def test_backend_signals_before_any_frame_are_real_zeros() -> None:
    signals = _backend_signals(50051, {}, [])
    assert signals["h2_streams_opened_total"] == 0
    assert signals["h2_rst_stream_total"] == {}
    assert signals["grpc_connections"] == 0


def test_factory_without_grpc_backends_is_unavailable_not_a_crash() -> None:
    from llmdiag.agent.wiring import build_collectors
    from llmdiag.model import CollectorState

    config = Config().with_backends(["http://127.0.0.1:8000"])
    running, unavailable = build_collectors(config, config.backend_list(), ["http2"])
    assert running == []
    assert unavailable["http2"].status is CollectorState.UNAVAILABLE
    assert "no grpc:// backends" in (unavailable["http2"].reason or "")
