"""ctypes -> Python conversion of BPF map entries and the key-by-key fallback
(llmdiag.bpf.maps); batch reads on a real kernel are in tests/root/test_bpf_loader.py."""

from __future__ import annotations

import ctypes
from typing import Any

from llmdiag.bpf.loader import plain
from llmdiag.bpf.maps import BatchReader, BatchUnsupported, converter, lookup_all


class Endpoint(ctypes.Structure):
    _fields_ = [("side", ctypes.c_ubyte), ("family", ctypes.c_ubyte), ("port", ctypes.c_ushort),
                ("addr", ctypes.c_ubyte * 16)]


class HistKey(ctypes.Structure):
    _fields_ = [("ep", Endpoint), ("slot", ctypes.c_uint)]


class Counters(ctypes.Structure):
    _fields_ = [("sends", ctypes.c_ulonglong), ("established", ctypes.c_longlong), ("cpu", ctypes.c_uint * 3),
                ("comm", ctypes.c_char * 8), ("eps", Endpoint * 2)]


def test_structs_arrays_and_scalars_become_plain_data() -> None:
    key = HistKey()
    key.ep.side, key.ep.family, key.ep.port, key.slot = 2, 2, 8000, 37
    key.ep.addr[:4] = [127, 0, 0, 1]
    assert plain(key) == {"ep": {"side": 2, "family": 2, "port": 8000, "addr": bytes([127, 0, 0, 1]) + bytes(12)},
                          "slot": 37}
    counters = Counters(sends=5, established=-1, comm=b"vllm")
    counters.cpu[:] = [1, 2, 3]
    counters.eps[1].port = 9
    out = plain(counters)
    assert out["sends"] == 5 and out["established"] == -1 and out["cpu"] == [1, 2, 3] and out["comm"] == b"vllm"
    assert out["eps"][1]["port"] == 9 and out["eps"][0]["addr"] == bytes(16)
    assert plain(ctypes.c_ulonglong(2**40)) == 2**40 and plain(ctypes.c_int(-3)) == -3
    assert plain(7) == 7 and plain(b"x") == b"x"


def test_one_converter_per_type() -> None:
    assert converter(HistKey) is converter(HistKey)
    assert converter(ctypes.c_uint)(ctypes.c_uint(4)) == 4


class FakeTable:
    """A bcc table as far as the fallback uses it: items() and del."""

    def __init__(self, entries: dict[int, int]) -> None:
        self.entries = {ctypes.c_uint(k).value: v for k, v in entries.items()}
        self.deleted: list[int] = []

    def items(self) -> list[tuple[Any, Any]]:
        return [(ctypes.c_uint(k), ctypes.c_ulonglong(v)) for k, v in self.entries.items()]

    def __delitem__(self, key: Any) -> None:
        self.deleted.append(key.value)
        if key.value == 2:
            raise KeyError(key)  # deleted meanwhile by the program: not an error
        del self.entries[key.value]


class RefusingReader(BatchReader):
    def __init__(self) -> None:  # no buffers: it never reads
        self.calls = 0

    def read(self, delete: bool = False) -> list[tuple[Any, Any]]:
        self.calls += 1
        raise BatchUnsupported("EINVAL")


def test_a_refused_batch_falls_back_key_by_key_and_is_not_retried() -> None:
    table, reader = FakeTable({1: 10, 2: 20, 3: 30}), RefusingReader()
    raw, after = lookup_all(table, reader)
    assert sorted((k.value, v.value) for k, v in raw) == [(1, 10), (2, 20), (3, 30)]
    assert after is None and reader.calls == 1
    raw, after = lookup_all(table, after, delete=True)
    assert len(raw) == 3 and sorted(table.deleted) == [1, 2, 3] and after is None
