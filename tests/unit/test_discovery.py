"""Engine discovery from listening sockets: a recorded /proc tree and the real one, with real servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
from pathlib import Path
import socket

from engine_http import FIXTURES, SHARED_ENGINES, ScriptedServer

from llmdiag.collectors.discovery import discover_engines, listening_sockets, socket_owners

VLLM = (SHARED_ENGINES / "vllm_v1_real_scrape_0.9era.prom").read_text()
TGI = (FIXTURES / "tgi_documented.prom").read_text()

TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
TCP6_HEADER = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def tcp_line(sl: int, local: str, state: str, inode: int, remote: str = "00000000:0000") -> str:
    return f"   {sl}: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"


def fake_proc(tmp_path, tcp: str, tcp6: str = "", fds: dict[int, list[int]] | None = None):
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP_HEADER + tcp)
    (tmp_path / "net" / "tcp6").write_text(TCP6_HEADER + tcp6)
    for pid, inodes in (fds or {}).items():
        fd_dir = tmp_path / str(pid) / "fd"
        fd_dir.mkdir(parents=True)
        for n, inode in enumerate(inodes, 3):
            os.symlink(f"socket:[{inode}]", fd_dir / str(n))
    return tmp_path


def test_listening_sockets_decodes_addresses_and_skips_other_states(tmp_path):
    # 0100007F:1F40 = 127.0.0.1:8000 (0x1F40; host-order u32, little-endian); 00000000:07E8 = 0.0.0.0:2024
    tcp = tcp_line(0, "0100007F:1F40", "0A", 111) + tcp_line(1, "00000000:07E8", "0A", 112) + \
        tcp_line(2, "0100007F:A597", "01", 113, "0100007F:871C")  # ESTABLISHED: not a listener
    # ::1 port 8001 as four little-endian words; :: port 8002
    tcp6 = tcp_line(0, "00000000000000000000000001000000:1F41", "0A", 114, "0" * 32 + ":0000") + \
        tcp_line(1, "0" * 32 + ":1F42", "0A", 115, "0" * 32 + ":0000")
    root = fake_proc(tmp_path, tcp, tcp6)
    found = {(s.host, s.port, s.inode) for s in listening_sockets(root)}
    assert found == {("127.0.0.1", 8000, 111), ("0.0.0.0", 2024, 112), ("::1", 8001, 114), ("::", 8002, 115)}


def test_garbled_or_missing_tables_give_fewer_sockets(tmp_path):
    root = fake_proc(tmp_path, "garbage line\n   0: zz:yy 00000000:0000 0A x x x x x 9\n")
    assert listening_sockets(root) == []
    assert listening_sockets(tmp_path / "nowhere") == []


def test_socket_owner_from_fd_links(tmp_path):
    root = fake_proc(tmp_path, "", fds={4242: [9, 111], 77: [5]})
    (tmp_path / "self").mkdir()  # non-numeric entries are not processes
    assert socket_owners([111, 5, 999], root) == {111: 4242, 5: 77}


def _hex_port(port: int) -> str:
    return f"0100007F:{port:04X}"


def test_discover_from_a_recorded_tree_probes_real_servers(tmp_path):
    models = json.dumps({"object": "list", "data": [{"id": "qwen-0.5b", "object": "model"}]})
    with ScriptedServer({"/metrics": [VLLM], "/v1/models": [models]}) as vllm, \
            ScriptedServer({"/metrics": [TGI]}) as tgi, \
            ScriptedServer({"/metrics": ["# TYPE python_info gauge\npython_info 1\n"]}) as plain:
        tcp = tcp_line(0, _hex_port(vllm.port), "0A", 501) + tcp_line(1, _hex_port(tgi.port), "0A", 502) + \
            tcp_line(2, _hex_port(plain.port), "0A", 503)
        root = fake_proc(tmp_path, tcp, fds={1234: [501], 5678: [502, 503]})
        found = discover_engines(proc_root=root, timeout=0.5)
    by_port = {b.port: b for b in found}
    assert set(by_port) == {vllm.port, tgi.port}  # the plain Python app is not an engine
    assert by_port[vllm.port].engine == "vllm" and by_port[vllm.port].pid == 1234
    assert by_port[vllm.port].models == ("qwen-0.5b",)  # from /v1/models
    assert by_port[tgi.port].engine == "tgi" and by_port[tgi.port].pid == 5678
    assert by_port[vllm.port].url == f"http://127.0.0.1:{vllm.port}"


def test_models_fall_back_to_metric_labels(tmp_path):
    with ScriptedServer({"/metrics": [VLLM]}) as vllm:  # /v1/models answers 404
        root = fake_proc(tmp_path, tcp_line(0, _hex_port(vllm.port), "0A", 601))
        (backend,) = discover_engines(proc_root=root, timeout=0.5)
    assert backend.models == ("/job/model/Qwen2.5-0.5B-Instruct",) and backend.pid is None


def test_a_listener_that_never_answers_does_not_hang_discovery(tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        port = silent.getsockname()[1]
        root = fake_proc(tmp_path, tcp_line(0, _hex_port(port), "0A", 701))
        assert discover_engines(proc_root=root, timeout=0.3) == []
    finally:
        silent.close()


def test_discover_on_the_real_proc_finds_our_own_server_and_pid():
    with ScriptedServer({"/metrics": [VLLM]}) as vllm:
        found = discover_engines(proc_root="/proc", timeout=0.5, ports=[vllm.port])
    assert [(b.port, b.engine, b.pid) for b in found] == [(vllm.port, "vllm", os.getpid())]


def test_configured_loopback_backend_gets_the_pid_of_its_listener() -> None:
    """`--backend http://127.0.0.1:PORT` is resolved to the local process listening there (this one)."""
    import os
    import socket as socketlib

    from llmdiag.agent import wiring
    from llmdiag.collectors.discovery import local_backend_pids
    from llmdiag.config import Config
    from llmdiag.model import Backend

    with socketlib.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        (backend,) = wiring.resolve_backends(Config().with_backends([f"http://127.0.0.1:{port}"]))
        assert backend.pid == os.getpid()
        assert local_backend_pids([Backend.from_url(f"http://localhost:{port}")]) == {f"localhost:{port}": os.getpid()}
        # Another host's address is never guessed at, even on the same port.
        assert local_backend_pids([Backend.from_url(f"http://10.255.0.1:{port}")]) == {}


def test_likely_owners_are_read_first_and_alone_when_they_hold_every_socket(tmp_path, monkeypatch):
    # A socket inherited across fork has two owners: the scan in pid order names the lower pid,
    # a likely pid is asked first and, holding every wanted socket, is the only one read.
    root = fake_proc(tmp_path, "", fds={77: [111], 4242: [111, 5], 9000: [6]})
    assert socket_owners([111, 5], root) == {111: 77, 5: 4242}
    assert socket_owners([111, 5], root, likely=[4242]) == {111: 4242, 5: 4242}
    # A likely pid that is gone or holds only part: the others are still read.
    assert socket_owners([111, 5, 6], root, likely=[31337, 4242]) == {111: 4242, 5: 4242, 6: 9000}
    scanned: list[str] = []
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: scanned.append(Path(path).parent.name) or real_scandir(path))
    assert socket_owners([111, 5], root, likely=[4242]) == {111: 4242, 5: 4242}
    assert scanned == ["4242"]  # no other process's descriptors were read


def test_live_listeners_come_from_sock_diag_and_match_proc_net_tcp(monkeypatch):
    import socket as socket_module

    from llmdiag.collectors import discovery
    from llmdiag.collectors.sockdiag import SockDiagError

    with socket_module.socket() as srv, socket_module.socket(socket_module.AF_INET6) as srv6:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv6.bind(("::1", 0))
        srv6.listen(1)
        mine = {discovery.ListeningSocket("127.0.0.1", srv.getsockname()[1], os.fstat(srv.fileno()).st_ino,
                                          socket_module.AF_INET),
                discovery.ListeningSocket("::1", srv6.getsockname()[1], os.fstat(srv6.fileno()).st_ino,
                                          socket_module.AF_INET6)}
        live = set(listening_sockets())
        from_files = set(listening_sockets("/proc/self/.."))  # another spelling of /proc: the files
        calls: list[int] = []

        def refused():
            calls.append(1)
            raise SockDiagError(1, "sock_diag: Operation not permitted")
            yield  # pragma: no cover - a generator, as the real one

        monkeypatch.setattr(discovery, "iter_listening", refused)
        fallback = set(listening_sockets())
    assert mine <= live and mine <= from_files and mine <= fallback
    assert calls == [1]  # sock_diag was asked, refused, and the files answered
    # The same host, read both ways a moment apart: other jobs may open or close listeners meanwhile.
    assert len(live ^ from_files) <= 4
