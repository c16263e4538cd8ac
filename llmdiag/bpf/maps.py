"""Reading whole BPF maps cheaply: batch lookups and a cached ctypes -> Python conversion.

A collector reads its maps once per tick. bcc's ``table.items()`` costs two
``bpf()`` syscalls per entry (``get_next_key``, then ``lookup``), each through
ctypes, and the loader then turned every ctypes struct into Python data with a
generic recursive walk. For the tcp collector's ``connect_hist`` (hundreds of
entries) that was most of its tick. Here:

* :func:`lookup_all` reads a map with ``BPF_MAP_LOOKUP_BATCH`` (Linux 5.6 for
  hash maps, 5.7 for arrays; one syscall per bucket run instead of two per
  entry) into key and value buffers kept per map between ticks, and falls back
  to bcc's per-key iteration, for good, on a kernel or map type that refuses
  it. ``delete=True`` uses ``BPF_MAP_LOOKUP_AND_DELETE_BATCH`` (hash maps only).
* :func:`converter` returns, per ctypes type, a function that turns an instance
  into plain Python data (the same result as the old recursive walk), built
  once per type.

bcc 0.26's own ``items_lookup_batch`` is not used: it passes the same
``c_uint32`` as the batch token and the count (libbpf writes the count back
over the kernel's token) and allocates ``max_entries`` buffers on every call.

bcc is imported inside functions only, like the loader.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable
from typing import Any

__all__ = ["BatchReader", "converter", "lookup_all"]

#: errnos that mean "this kernel or this map type has no batch operations":
#: EINVAL (kernels before 5.6, or a map type without them), ENOTSUPP (524, the
#: kernel-internal value that leaks out of the bpf syscall), EOPNOTSUPP, ENOSYS.
_UNSUPPORTED = frozenset({errno.EINVAL, 524, errno.EOPNOTSUPP, errno.ENOSYS})

#: First buffer size in entries; it doubles (up to the map's max_entries) when a read does not fit.
_FIRST_CAPACITY = 64


class BatchUnsupported(Exception):
    """The kernel refused a batch operation on this map (see :data:`_UNSUPPORTED`)."""


class BatchReader:
    """Key and value buffers for batch reads of one bcc table, reused tick after tick.

    Not thread-safe: one reader per table, used by the collector that owns the program."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.max_entries = max(1, int(getattr(table, "max_entries", 0) or 0) or 1 << 16)
        self.capacity = 0
        self._keys: Any = None
        self._values: Any = None
        self._grow(min(_FIRST_CAPACITY, self.max_entries))

    def _grow(self, capacity: int, keep: int = 0) -> None:
        """Buffers for ``capacity`` entries, the first ``keep`` entries copied over."""
        keys, values = (self.table.Key * capacity)(), (self.table.Leaf * capacity)()
        if keep:
            ctypes.memmove(keys, self._keys, ctypes.sizeof(self.table.Key) * keep)
            ctypes.memmove(values, self._values, ctypes.sizeof(self.table.Leaf) * keep)
        self.capacity, self._keys, self._values = capacity, keys, values

    def read(self, delete: bool = False) -> list[tuple[Any, Any]]:
        """Every ``(key, value)`` of the map as ctypes copies (they outlive the buffers).

        Raises :class:`BatchUnsupported` when the kernel has no batch operation for this map,
        ``OSError`` for any other failure."""
        from bcc.libbcc import lib  # noqa: PLC0415 - lazy: bcc is optional

        batch = lib.bpf_lookup_and_delete_batch if delete else lib.bpf_lookup_batch
        key_size, value_size = ctypes.sizeof(self.table.Key), ctypes.sizeof(self.table.Leaf)
        fd = self.table.map_fd
        # The token is opaque to user space: a bucket index for hash maps, a key (u32) for
        # arrays. Four u32 leave room for either.
        token_in, token_out = (ctypes.c_uint32 * 4)(), (ctypes.c_uint32 * 4)()
        p_in = ctypes.cast(token_in, ctypes.POINTER(ctypes.c_uint32))
        p_out = ctypes.cast(token_out, ctypes.POINTER(ctypes.c_uint32))
        total, first = 0, True
        while True:
            if total >= self.capacity:
                if self.capacity >= self.max_entries:
                    break  # as many entries as the map can hold: nothing can be left
                self._grow(min(self.capacity * 2, self.max_entries), keep=total)
            count = ctypes.c_uint32(self.capacity - total)
            res = batch(fd, None if first else p_in, p_out, ctypes.byref(self._keys, key_size * total),
                        ctypes.byref(self._values, value_size * total), ctypes.byref(count))
            err = ctypes.get_errno() if res != 0 else 0
            if res != 0 and err == errno.ENOSPC and self.capacity < self.max_entries:
                # The next hash bucket holds more entries than there is room left (the kernel
                # copies a bucket whole, and copied nothing): grow and ask again from the same place.
                self._grow(min(self.capacity * 2, self.max_entries), keep=total)
                continue
            total += count.value
            if res != 0:
                if err == errno.ENOENT:
                    break  # the whole map was walked; count holds the last run
                if err in _UNSUPPORTED and first and total == 0:
                    raise BatchUnsupported(errno.errorcode.get(err, str(err)))
                raise OSError(err, f"BPF map batch lookup failed: {errno.errorcode.get(err, str(err))}")
            first = False
            ctypes.memmove(token_in, token_out, ctypes.sizeof(token_in))
        # Copies: the buffers are overwritten by the next read.
        key_copy, value_copy = self.table.Key.from_buffer_copy, self.table.Leaf.from_buffer_copy
        keys, values = self._keys, self._values
        return [(key_copy(keys, i * key_size), value_copy(values, i * value_size)) for i in range(total)]


def lookup_all(table: Any, reader: BatchReader | None, delete: bool = False) -> tuple[list[tuple[Any, Any]], BatchReader | None]:
    """Every entry of ``table``: by batch when ``reader`` is given and the kernel allows it, else by
    bcc's per-key iteration. Returns the entries and the reader to pass next time (``None`` once
    the kernel refused batches for this map: no syscall is wasted on asking again)."""
    if reader is not None:
        try:
            return reader.read(delete=delete), reader
        except BatchUnsupported:
            reader = None
    raw = list(table.items())
    if delete:
        for key, _ in raw:
            try:
                del table[key]
            except KeyError:
                pass
    return raw, None


_CONVERTERS: dict[type, Callable[[Any], Any]] = {}


def _identity(value: Any) -> Any:
    return value


def _simple_value(value: Any) -> Any:
    return value.value


def converter(ctype: type) -> Callable[[Any], Any]:
    """A function turning an instance of ``ctype`` into plain Python data: a struct or union
    becomes a dict of its fields, a byte array ``bytes``, another array a list, a simple
    ctypes value its ``.value``. Built once per type (ctypes struct field access already
    yields Python ints for scalar fields; only nested types need converting)."""
    cached = _CONVERTERS.get(ctype)
    if cached is not None:
        return cached
    fn: Callable[[Any], Any]
    if issubclass(ctype, ctypes.Structure | ctypes.Union):
        fields = []
        for name, field_type, *_ in ctype._fields_:
            nested = issubclass(field_type, ctypes.Structure | ctypes.Union | ctypes.Array)
            fields.append((name, converter(field_type) if nested else None))
        if all(conv is None for _, conv in fields):
            names = tuple(name for name, _ in fields)

            def fn(value: Any, names: tuple[str, ...] = names) -> dict[str, Any]:
                return {name: getattr(value, name) for name in names}
        else:
            def fn(value: Any, fields: list[tuple[str, Any]] = fields) -> dict[str, Any]:
                return {name: (conv(getattr(value, name)) if conv is not None else getattr(value, name))
                        for name, conv in fields}
    elif issubclass(ctype, ctypes.Array):
        if ctype._type_ in (ctypes.c_ubyte, ctypes.c_byte, ctypes.c_char):
            fn = bytes
        else:
            element = ctype._type_
            if issubclass(element, ctypes.Structure | ctypes.Union | ctypes.Array):
                inner = converter(element)

                def fn(value: Any, inner: Callable[[Any], Any] = inner) -> list[Any]:
                    return [inner(v) for v in value]
            else:
                fn = list  # elements of simple types come out of an array as Python values
    elif issubclass(ctype, ctypes._SimpleCData):
        fn = _simple_value
    else:
        fn = _identity
    _CONVERTERS[ctype] = fn
    return fn
