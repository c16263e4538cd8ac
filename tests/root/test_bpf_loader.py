"""The bcc loader on the running kernel: compile, auto-attach, count real loopback
connections, count map-full failures, detach (SPEC section 2); map updates with
exist conditions, named error slots, tail calls, per-pid uprobe detach, and a
compiler that calls exit() (SPEC section 2)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmdiag.bpf import features
from llmdiag.bpf.loader import AttachPoint, BPFUnavailable, Program, choose

pytestmark = pytest.mark.root

# TCP states (include/net/tcp_states.h)
ESTABLISHED, SYN_SENT, SYN_RECV, FIN_WAIT1, FIN_WAIT2, CLOSE, CLOSE_WAIT, LAST_ACK = 1, 2, 3, 4, 5, 7, 8, 9


def _listener() -> socket.socket:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(128)
    return srv


def _connect_and_close(srv: socket.socket, count: int) -> None:
    port = srv.getsockname()[1]
    for _ in range(count):
        client = socket.create_connection(("127.0.0.1", port))
        server_side, _ = srv.accept()
        client.close()  # the client closes first: it is the active closer
        server_side.close()


def _transitions(prog: Program) -> dict[tuple[int, int], int]:
    return {(key >> 8, key & 0xFF): value for key, value in prog.read_hash("transitions")}


def _wait_for(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_selftest_counts_real_loopback_connections() -> None:
    with _listener() as srv:
        port = srv.getsockname()[1]
        prog = Program.load("selftest", {"SELFTEST_PORT": port})
        try:
            assert "tracepoint:sock:inet_sock_set_state" in prog.attached
            _connect_and_close(srv, 25)
            _wait_for(lambda: _transitions(prog).get((LAST_ACK, CLOSE), 0) >= 25)
            counts = _transitions(prog)
            errors = prog.errors()
        finally:
            prog.close()
    assert counts[(CLOSE, SYN_SENT)] == 25  # client connect()
    assert counts[(SYN_SENT, ESTABLISHED)] == 25
    assert counts[(SYN_RECV, ESTABLISHED)] == 25  # server side handshake done
    assert counts[(ESTABLISHED, FIN_WAIT1)] == 25  # client closes first
    assert counts[(ESTABLISHED, CLOSE_WAIT)] == 25  # server sees the peer close
    assert counts[(LAST_ACK, CLOSE)] == 25
    assert errors["map_full"] == 0


def test_map_full_failures_are_counted() -> None:
    with _listener() as srv:
        prog = Program.load("selftest", {"SELFTEST_PORT": srv.getsockname()[1], "MAX_TRANSITIONS": 2})
        try:
            _connect_and_close(srv, 5)
            _wait_for(lambda: prog.errors()["map_full"] >= 5 * 10 - 2)
            assert len(_transitions(prog)) == 2
            # 10 transitions per connection (5 per side); only 2 distinct keys fit.
            assert sum(_transitions(prog).values()) + prog.errors()["map_full"] == 50
        finally:
            prog.close()


def test_close_detaches_and_is_idempotent() -> None:
    with _listener() as srv:
        prog = Program.load("selftest", {"SELFTEST_PORT": srv.getsockname()[1]})
        table = prog.table("transitions")
        prog.close()
        prog.close()
        assert prog.closed and prog.attached == []
        assert prog.bpf.num_open_tracepoints() == 0
        del table


def test_attach_point_choice_prefers_what_the_kernel_has() -> None:
    candidates = [
        AttachPoint("tracepoint", "tcp:no_such_tracepoint", "f"),
        AttachPoint("kprobe", "tcp_sendmsg", "f"),
        AttachPoint("tracepoint", "sock:sock_send_length", "f"),
    ]
    chosen = choose(candidates)
    if features.kprobes_supported():
        assert chosen is not None and chosen.kind == "kprobe"
    else:
        assert chosen == candidates[2]


def test_compile_error_is_bpf_unavailable_with_reason() -> None:
    with pytest.raises(BPFUnavailable) as info:
        Program.load("selftest", {"SELFTEST_PORT": "undefined_identifier_xyz"})
    assert "undefined_identifier_xyz" in info.value.reason
    assert info.value.hint


# -- the API that collectors use instead of bcc internals ---------------------------------

_UNUSED_PORT = 9  # discard: nothing on loopback uses it in these tests, so the program writes nothing


def test_update_map_insert_only_overwrite_only_and_full() -> None:
    prog = Program.load("selftest", {"SELFTEST_PORT": _UNUSED_PORT, "MAX_TRANSITIONS": 2})
    try:
        assert prog.update_map("transitions", 7, 1, exist="noexist") is True
        assert prog.update_map("transitions", 7, 2, exist="noexist") is False  # kept the first value
        assert dict(prog.read_hash("transitions")) == {7: 1}
        assert prog.update_map("transitions", 8, 5, exist="exist") is False  # nothing to overwrite
        assert prog.update_map("transitions", 7, 3, exist="exist") is True
        table = prog.table("transitions")
        assert prog.update_map("transitions", table.Key(8), table.Leaf(4)) is True  # "any", ctypes values
        assert dict(prog.read_hash("transitions")) == {7: 3, 8: 4}
        with pytest.raises(OSError) as full:
            prog.update_map("transitions", 9, 1, exist="noexist")
        assert full.value.errno == errno.E2BIG and "map full" in str(full.value)
        with pytest.raises(ValueError):
            prog.update_map("transitions", 9, 1, exist="sometimes")
        with pytest.raises(ValueError):
            prog.update_map("transitions", {"no_such_field": 1}, 1)
        with pytest.raises(TypeError):
            prog.update_map("transitions", "7", 1)
        with pytest.raises(KeyError):
            prog.update_map("no_such_map", 1, 1)
    finally:
        prog.close()
    with pytest.raises(BPFUnavailable):
        prog.update_map("transitions", 1, 1)


def test_shared_reads_give_what_plain_reads_give_as_entries_change() -> None:
    prog = Program.load("selftest", {"SELFTEST_PORT": _UNUSED_PORT})
    try:
        for step in ({7: 1}, {7: 1, 8: 2}, {7: 3}, {9: 4}):
            for key, value in step.items():
                prog.update_map("transitions", key, value)
            assert prog.read_hash("transitions", shared=True) == prog.read_hash("transitions")
        assert dict(prog.read_hash("transitions", shared=True)) == {7: 3, 8: 2, 9: 4}
    finally:
        prog.close()


def test_batch_reads_match_key_by_key_reads_past_the_first_buffer_and_clear() -> None:
    # 1,000 entries: more than the batch reader's first buffer (64), so it grows mid-walk.
    prog = Program.load("selftest", {"SELFTEST_PORT": _UNUSED_PORT, "MAX_TRANSITIONS": 4096})
    try:
        expected = {key: key * 3 + 1 for key in range(1000)}
        for key, value in expected.items():
            prog.update_map("transitions", key, value)
        table = prog.table("transitions")
        assert prog.table("transitions") is table  # one bcc table object, not a new one per call
        by_key = {k.value: v.value for k, v in table.items()}
        assert by_key == expected
        assert dict(prog.read_hash("transitions")) == expected
        assert prog._readers["transitions"] is not None  # the batch path was taken (kernel >= 5.6)
        assert dict(prog.read_hash("transitions")) == expected  # the buffers are reused, results copied
        prog.update_map("llmdiag_errors", 1, 7)
        assert prog.read_array("llmdiag_errors")[:2] == [0, 7]
        assert dict(prog.read_hash("transitions", clear=True)) == expected
        assert prog.read_hash("transitions") == []
        prog.update_map("transitions", 5, 6)
        assert prog.read_hash("transitions") == [(5, 6)]
    finally:
        prog.close()


def test_reads_fall_back_to_key_by_key_when_the_kernel_refuses_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmdiag.bpf import maps

    def refuse(self: maps.BatchReader, delete: bool = False) -> list:
        raise maps.BatchUnsupported("EINVAL")

    monkeypatch.setattr(maps.BatchReader, "read", refuse)
    prog = Program.load("selftest", {"SELFTEST_PORT": _UNUSED_PORT})
    try:
        for key in range(10):
            prog.update_map("transitions", key, key + 100)
        assert dict(prog.read_hash("transitions")) == {k: k + 100 for k in range(10)}
        assert prog._readers["transitions"] is None  # not asked again
        prog.update_map("llmdiag_errors", 0, 2)
        assert prog.errors()["map_full"] == 2
        assert len(dict(prog.read_hash("transitions", clear=True))) == 10
        assert prog.read_hash("transitions") == []
    finally:
        prog.close()


def test_errors_reports_every_slot_and_names_added_by_the_program() -> None:
    prog = Program.load("selftest", {"SELFTEST_PORT": _UNUSED_PORT})
    try:
        assert prog.errors() == {"lost_events": 0, "map_full": 0, "read": 0}
        prog.update_map("llmdiag_errors", 2, 5)  # as if the program had counted its own error 5 times
        assert prog.errors()["slot_2"] == 5  # an unnamed slot is still reported once it counts
        prog.name_errors({2: "tail_call"})
        assert prog.errors() == {"lost_events": 0, "map_full": 0, "read": 0, "tail_call": 5}
        prog.name_errors({2: "tail_call"})  # naming a slot again the same way is fine
        for clash in ({2: "other"}, {3: "map_full"}, {3: "lost_events"}, {-1: "x"}, {3: "Bad Name"}):
            with pytest.raises(ValueError):
                prog.name_errors(clash)
    finally:
        prog.close()


def test_load_function_and_prog_array_install_a_tail_call() -> None:
    prog = Program.load("http2_frames")
    try:
        fd = prog.load_function("h2_walk", "tracepoint")
        assert fd > 2 and os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-prog"
        assert prog.load_function("h2_walk", "tracepoint") == fd  # loaded once
        prog.set_prog_array("walkers", 0, fd)
        with pytest.raises(BPFUnavailable, match="out of range"):
            prog.set_prog_array("walkers", 1, fd)  # BPF_PROG_ARRAY(walkers, 1)
        with pytest.raises(BPFUnavailable, match="walkers"):
            prog.set_prog_array("walkers", 0, 0)  # fd 0 is not a BPF program
        with pytest.raises(ValueError):
            prog.set_prog_array("walkers", -1, fd)
        with pytest.raises(KeyError):
            prog.set_prog_array("no_such_map", 0, fd)
        with pytest.raises(BPFUnavailable, match="no_such_function"):
            prog.load_function("no_such_function")
        with pytest.raises(ValueError):
            prog.load_function("h2_walk", "lsm")
    finally:
        prog.close()


def test_load_function_rejected_by_the_verifier_is_bpf_unavailable() -> None:
    # walkers belongs to the tracepoint programs: a kprobe program may not tail-call through it.
    prog = Program.load("http2_frames")
    try:
        with pytest.raises(BPFUnavailable) as info:
            prog.load_function("h2_walk", "kprobe")
        assert "h2_walk" in info.value.reason and "Invalid argument" in info.value.reason
    finally:
        prog.close()


def _libc_path(pid: int) -> str:
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libc.so" in path or "/libc-" in path:
            return path
    raise AssertionError(f"pid {pid} maps no libc")


def test_detach_uprobes_of_one_pid_after_it_exited() -> None:
    children = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    prog = Program.load("cuda_alloc")
    try:
        for child in children:
            _wait_for(lambda child=child: "libc" in Path(f"/proc/{child.pid}/maps").read_text())
            library = f"/proc/{child.pid}/root{_libc_path(child.pid)}"
            prog.attach_uretprobe(library, "malloc", "ret_mem_alloc", child.pid)
            prog.attach_uprobe(library, "malloc", "on_mem_alloc", child.pid)
        assert len(prog.attached) == 4
        gone, alive = children
        gone.kill()
        gone.wait()
        assert not Path(f"/proc/{gone.pid}").exists()  # /proc/PID/root, the attach path, is gone too
        assert prog.detach_uprobes(gone.pid) == 2
        assert prog.detach_uprobes(gone.pid) == 0
        assert len(prog.attached) == 2 and all(f"/proc/{alive.pid}/" in what for what in prog.attached)
        assert prog.detach_uprobes(alive.pid) == 2
        assert prog.attached == []
    finally:
        prog.close()
        for child in children:
            child.kill()
            child.wait()


# -- a compiler that exits instead of returning an error ------------------------------------

_BIG_STACK = """
#include <uapi/linux/ptrace.h>
int big_stack(struct pt_regs *ctx)
{
    volatile char buf[600];  /* over the BPF stack limit of 512 bytes */
    for (int i = 0; i < 600; i++)
        buf[i] = i;
    return buf[bpf_get_prandom_u32() % 600];
}
"""

_LOAD_FROM = """
import sys
from pathlib import Path
import llmdiag.bpf.loader as loader
loader.BPF_DIR = Path(sys.argv[1])
try:
    loader.Program.load("big_stack")
except loader.BPFUnavailable as exc:
    print(f"BPFUnavailable: {exc.reason}", file=sys.stderr)
    sys.exit(3)
print("loaded")
"""


def test_llvm_exiting_during_compile_still_says_why(tmp_path: Path) -> None:
    (tmp_path / "big_stack.bpf.c").write_text(_BIG_STACK)
    proc = subprocess.run([sys.executable, "-c", _LOAD_FROM, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    # LLVM 14-16 exit(1) here; a bcc that returns the error instead gives BPFUnavailable (exit 3).
    assert proc.returncode != 0 and "loaded" not in proc.stdout
    assert "stack limit of 512 bytes" in proc.stderr, proc.stderr


_EXIT_INSIDE_CAPTURE = """
import ctypes, os, sys
from llmdiag.bpf import features
for _ in range(50):  # captures that end normally leave no exit handler behind
    with features.captured_stderr() as captured:
        os.write(2, b"quiet")
    assert captured.text == "quiet"
if sys.argv[1] == "exit":
    with features.captured_stderr():
        os.write(2, b"fatal: what the compiler said\\n")
        ctypes.CDLL(None).exit(7)  # as LLVM does: the C library's exit, no Python unwinding
"""


def test_exit_inside_a_stderr_capture_writes_the_capture_out() -> None:
    died = subprocess.run([sys.executable, "-c", _EXIT_INSIDE_CAPTURE, "exit"],
                          capture_output=True, text=True, timeout=60)
    assert died.returncode == 7
    assert "fatal: what the compiler said" in died.stderr and "quiet" not in died.stderr
    clean = subprocess.run([sys.executable, "-c", _EXIT_INSIDE_CAPTURE, "normal"],
                           capture_output=True, text=True, timeout=60)
    assert clean.returncode == 0 and clean.stderr == ""
