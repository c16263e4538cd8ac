"""Finding libcuda in /proc/PID/maps, reading its exported functions, walking the
process tree: the CUDA tracer's discovery, on recorded files and a compiled stand-in."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmdiag.collectors import cuda_libs
from llmdiag.collectors.cuda_alloc import PROBES, REQUIRED_SYMBOLS
from llmdiag.collectors.cuda_libs import (
    ElfError,
    MappedLibrary,
    descendants,
    exported_functions,
    find_library,
    parse_maps,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FAKE = FIXTURES / "fake_libcuda"
NAMES = ("libcuda.so",)
ALL_SYMBOLS = {symbol for symbol, _ in PROBES}

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build the stand-in libcuda")


def build_library(directory: Path, *defines: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", *[f"-D{d}" for d in defines], "-o", str(out),
                    str(FAKE / "fake_libcuda.c"), "-lpthread"], check=True, capture_output=True, timeout=60)
    return out


# -- /proc/PID/maps -----------------------------------------------------------------


def test_recorded_maps_find_the_driver_not_the_runtime() -> None:
    text = (FAKE / "maps_engine.txt").read_text()
    assert "libcudart.so.12" in text.split("libcuda.so.550")[0]  # the runtime comes first in the file
    assert parse_maps(text, NAMES) == MappedLibrary("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", deleted=False)


def test_maps_without_the_driver() -> None:
    text = (FAKE / "maps_engine.txt").read_text()
    without = "\n".join(line for line in text.splitlines() if "libcuda.so" not in line)
    assert parse_maps(without, NAMES) is None
    assert parse_maps("", NAMES) is None


def test_deleted_mapping_and_spaces_and_junk_lines() -> None:
    text = (
        "garbage\n"
        "7f00-7f01 rw-p 00000000 00:00 0\n"  # anonymous: no path
        "7f01-7f02 rw-p 00000000 00:00 0                          [heap]\n"
        "7f02-7f03 r-xp 00001000 fe:00 42                         /opt/my driver/libcuda.so.1 (deleted)\n"
    )
    assert parse_maps(text, NAMES) == MappedLibrary("/opt/my driver/libcuda.so.1", deleted=True)


def test_configured_names() -> None:
    text = "7f02-7f03 r-xp 00001000 fe:00 42     /usr/lib/libnvcuda.so.2\n"
    assert parse_maps(text, NAMES) is None
    assert parse_maps(text, ("libnvcuda.so",)) == MappedLibrary("/usr/lib/libnvcuda.so.2")


def test_find_library_on_a_proc_tree(tmp_path: Path) -> None:
    (tmp_path / "4242").mkdir()
    shutil.copy(FAKE / "maps_engine.txt", tmp_path / "4242" / "maps")
    assert find_library(4242, NAMES, tmp_path).path.endswith("libcuda.so.550.54.15")  # type: ignore[union-attr]
    assert find_library(4243, NAMES, tmp_path) is None  # gone (or never was): not an error


# -- exported functions ---------------------------------------------------------------


@needs_gcc
def test_exported_functions_of_the_stand_in(tmp_path: Path) -> None:
    full = exported_functions(build_library(tmp_path / "full"))
    assert ALL_SYMBOLS <= full
    assert "fake_cuda_set_limit" in full
    assert "fake_alloc" not in full  # static: not exported
    assert "pthread_mutex_lock" not in full  # imported (undefined here), not exported
    old = exported_functions(build_library(tmp_path / "old", "FAKE_CUDA_NO_ASYNC", "FAKE_CUDA_NO_VMM"))
    assert old & ALL_SYMBOLS == set(REQUIRED_SYMBOLS)


@needs_gcc
def test_exported_functions_agree_with_bcc(tmp_path: Path) -> None:
    bcc = pytest.importorskip("bcc")
    path = build_library(tmp_path)
    theirs = {name.decode() for name, _ in bcc.BPF.get_user_functions_and_addresses(str(path).encode(), rb"cuMem.*")}
    assert {n for n in exported_functions(path) if n.startswith("cuMem")} == theirs


def test_non_elf_and_broken_files(tmp_path: Path) -> None:
    text = tmp_path / "libcuda.so.1"
    text.write_text("INPUT(libcuda.so.550)\n")  # a linker script, as some distros ship
    with pytest.raises(ElfError, match="not an ELF"):
        exported_functions(text)
    elf32 = tmp_path / "elf32.so"
    elf32.write_bytes(b"\x7fELF\x01\x01\x01" + bytes(57))
    with pytest.raises(ElfError, match="64-bit little-endian"):
        exported_functions(elf32)
    no_sections = tmp_path / "nosections.so"
    no_sections.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(57))
    with pytest.raises(ElfError, match="no section headers"):
        exported_functions(no_sections)


@needs_gcc
def test_truncated_library(tmp_path: Path) -> None:
    whole = build_library(tmp_path).read_bytes()
    cut = tmp_path / "cut.so"
    cut.write_bytes(whole[: len(whole) // 2])  # section headers sit at the end of the file
    with pytest.raises(ElfError, match="truncated|past the end"):
        exported_functions(cut)


# -- process tree -------------------------------------------------------------------


def test_descendants_on_the_recorded_proc_tree() -> None:
    # tests/fixtures/proc/host618: 4100 (vllm) with tensor-parallel workers 4101..4108.
    tree = descendants([4100], FIXTURES / "proc" / "host618")
    assert tree == {pid: 4100 for pid in range(4100, 4109)}
    assert descendants([4101], FIXTURES / "proc" / "host618") == {4101: 4101}
    assert descendants([9999], FIXTURES / "proc" / "host618") == {}  # a root that is gone


def _stat(root: Path, pid: int, comm: str, ppid: int) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} 1 0 -1 4194304 99 0 0 0\n")


def test_descendants_tricky_comm_grandchildren_and_loops(tmp_path: Path) -> None:
    _stat(tmp_path, 10, "api server", 1)
    _stat(tmp_path, 11, "a) S 999 (b", 10)  # a comm that fakes a ppid of 999
    _stat(tmp_path, 12, "worker", 11)  # grandchild
    _stat(tmp_path, 20, "other", 1)
    _stat(tmp_path, 30, "loop-a", 31)  # a parent loop (malformed recording) must terminate
    _stat(tmp_path, 31, "loop-b", 30)
    (tmp_path / "40").mkdir()  # exited between listing and reading: no stat
    (tmp_path / "self").mkdir()
    assert descendants([10, 30], tmp_path) == {10: 10, 11: 10, 12: 10, 30: 30, 31: 30}
    assert descendants([], tmp_path) == {}
    assert descendants([10], tmp_path / "missing") == {}


def test_descendants_give_each_process_its_virtual_size(tmp_path: Path) -> None:
    fields = " ".join(str(n) for n in range(4, 23))  # fields 4..22, then vsize (23) and rss (24)
    for pid, ppid, vsize in ((10, 1, 1_000_000), (11, 10, 2_500_000)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (we) ird) S {ppid} {fields.split(' ', 1)[1]} {vsize} 77\n")
    _stat(tmp_path, 12, "short", 10)  # a line without a vsize field: no size, still a descendant
    sizes: dict[int, int] = {}
    assert descendants([10], tmp_path, sizes) == {10: 10, 11: 10, 12: 10}
    assert sizes == {10: 1_000_000, 11: 2_500_000}


_TREE = """
import subprocess, sys, threading
kids = [subprocess.Popen(["sleep", "60"])]
def from_a_thread():  # a child whose parent is not the main thread: listed in that thread's children file
    kids.append(subprocess.Popen(["sleep", "60"]))
t = threading.Thread(target=from_a_thread); t.start(); t.join()
kids.append(subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
    "g = subprocess.Popen(['sleep', '60']); print(g.pid, flush=True); sys.stdin.read()"],
    stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True))
grandchild = kids[-1].stdout.readline().strip()
print(" ".join(str(k.pid) for k in kids), grandchild, flush=True)
sys.stdin.read()
for k in kids:
    k.kill()
"""


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
                    reason="no /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")
def test_descendants_down_the_children_files_are_the_walk_on_a_live_tree() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
                              start_new_session=True)  # its own process group: the whole tree is killed after
    try:
        assert parent.stdout is not None
        pids = {int(p) for p in parent.stdout.readline().split()} | {parent.pid}
        assert len(pids) == 5
        names = [n for n in os.listdir("/proc") if n.isdigit()]
        walked_sizes: dict[int, int] = {}
        walked = cuda_libs._walk([parent.pid], "/proc", names, walked_sizes)
        sizes: dict[int, int] = {}
        down = cuda_libs._down_children([parent.pid], "/proc", 1 << 30, sizes)
        assert down == walked == {pid: parent.pid for pid in pids}
        assert set(sizes) == pids and all(sizes[p] > 0 for p in pids)
        assert descendants([parent.pid]) == walked
        # More files than the walk would read: it gives up (and descendants() walks instead).
        assert cuda_libs._down_children([parent.pid], "/proc", 3, None) is None
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert descendants([parent.pid]) == {}  # a root that is gone
