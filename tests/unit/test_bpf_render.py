"""render() and cflags(): the program text without bcc, root or a kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmdiag.bpf.loader import BPFUnavailable, cflags, render, source_path


def test_import_does_not_need_bcc() -> None:
    code = (
        "import sys; sys.modules['bcc'] = None\n"  # any 'import bcc' now raises ImportError
        "import llmdiag.bpf.loader as l; print(l.render('selftest', {'SELFTEST_PORT': 1}).count('#define'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 1


def test_render_shows_defines_and_inlines_local_headers() -> None:
    text = render("selftest", {"SELFTEST_PORT": 8000, "MAX_TRANSITIONS": 64})
    assert "#define MAX_TRANSITIONS 64" in text
    assert "#define SELFTEST_PORT 8000" in text
    assert "-DSELFTEST_PORT=8000" in text
    assert "begin common.h" in text and "LLMDIAG_ERR_MAP_FULL" in text
    assert "begin selftest.h" in text and "transition_key" in text
    assert '#include "common.h"' not in text
    assert "#include <uapi/linux/in.h>" in text  # system headers stay includes
    assert "TRACEPOINT_PROBE(sock, inet_sock_set_state)" in text


def test_tcp_health_renders_with_its_defines() -> None:
    text = render("tcp_health", {"MAX_SOCKS": 1234, "HAVE_SOCK_SEND_LENGTH": 1})
    assert "#define MAX_SOCKS 1234" in text
    assert "begin tcp_health.h" in text


def test_cflags_are_sorted_defines_plus_include_dir() -> None:
    flags = cflags({"B_OPT": True, "A_OPT": 3})
    assert flags[0].startswith("-I") and flags[0].endswith("llmdiag/bpf")
    assert flags[1:] == ["-DA_OPT=3", "-DB_OPT=1"]


@pytest.mark.parametrize("name,value", [("lower", 1), ("X", "1; evil()"), ("Y", "a b")])
def test_bad_defines_are_rejected(name: str, value: object) -> None:
    with pytest.raises(ValueError):
        cflags({name: value})


def test_missing_program_is_bpf_unavailable() -> None:
    with pytest.raises(BPFUnavailable) as info:
        source_path("no_such_program")
    assert "missing" in info.value.reason
    with pytest.raises(ValueError):
        source_path("../etc/passwd")


def test_tcp_health_kprobe_fallback_is_in_the_program_text() -> None:
    text = render("tcp_health", {"SEND_PATH": 2})
    assert "#define SEND_PATH 2" in text
    assert "int on_tcp_sendmsg(struct pt_regs *ctx" in text and "on_tcp_sendmsg_ret" in text


def test_connect_latency_slots_cover_the_line_without_gaps() -> None:
    from llmdiag.collectors.tcp import slot_bounds_us

    # latency_slot() in tcp_health.bpf.c: exact below 4 us, then 4 buckets per power of two
    assert [slot_bounds_us(s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert slot_bounds_us(8) == (4, 5) and slot_bounds_us(11) == (7, 8)
    previous_upper = 4.0
    for slot in range(8, 4 * 40):
        lower, upper = slot_bounds_us(slot)
        assert lower == previous_upper and upper > lower
        previous_upper = upper


def test_tcp_collector_without_bcc_is_unavailable_with_a_hint() -> None:
    code = (
        "import sys; sys.modules['bcc'] = None\n"
        "from llmdiag.collectors.tcp import TcpCollector\n"
        "from llmdiag.model import Backend\n"
        "c = TcpCollector(backends=[Backend.from_url('http://127.0.0.1:8000')])\n"
        "s = c.status(); print(s.status.value); print(s.reason); print(c.collect(0.0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "unavailable"
    assert "bcc" in out[1] and "python3-bpfcc" in out[1]
    assert out[2] == "[]"
