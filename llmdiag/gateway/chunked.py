"""The chunked transfer coding (RFC 9112 7.1), decoded incrementally: shared by the gateway's two sides."""

from __future__ import annotations

__all__ = ["ChunkedDecoder", "ChunkedError"]

#: Longest chunk-size line (hex digits plus extensions), and longest trailer section.
MAX_CHUNK_LINE = 4096
MAX_TRAILERS = 64 * 1024
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_SIZE, _DATA, _CRLF, _TRAILER = range(4)


class ChunkedError(ValueError):
    """Bytes that are not the chunked coding."""


class ChunkedDecoder:
    """``feed(bytes) -> list of body pieces``; :attr:`done` after the last chunk and the trailers.

    Pieces are slices of what was fed (no copy for a chunk that arrived whole);
    a size line or CRLF split across reads is kept until the next one.
    Bytes after the end are counted in :attr:`extra` (the caller decides).
    """

    __slots__ = ("_buf", "_remaining", "_state", "_trailer_bytes", "done", "extra")

    def __init__(self) -> None:
        self._buf = b""
        self._remaining = 0
        self._state = _SIZE
        self._trailer_bytes = 0
        self.done = False
        self.extra = 0

    def feed(self, data: bytes) -> list[bytes]:
        pieces: list[bytes] = []
        if self.done:
            self.extra += len(data)
            return pieces
        if self._buf:
            data = self._buf + data
            self._buf = b""
        pos, n = 0, len(data)
        while pos < n:
            state = self._state
            if state == _DATA:
                take = min(self._remaining, n - pos)
                pieces.append(data[pos:pos + take] if (pos or take != n) else data)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _CRLF
            elif state == _CRLF:
                if n - pos < 2:
                    break
                if data[pos:pos + 2] != b"\r\n":
                    raise ChunkedError("chunk data not followed by CRLF")
                pos += 2
                self._state = _SIZE
            else:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        raise ChunkedError("chunk size line too long")
                    break
                if eol - pos > MAX_CHUNK_LINE:  # also when the whole line came in one read
                    raise ChunkedError("chunk size line too long" if state == _SIZE else "trailer line too long")
                line = data[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    self._trailer_bytes += len(line) + 2
                    if self._trailer_bytes > MAX_TRAILERS:
                        raise ChunkedError("trailer section too long")
                    if not line:
                        self.done = True
                        self.extra = n - pos
                        return pieces
                    continue
                size_text = line.split(b";", 1)[0].strip(b" \t")
                # int(x, 16) also takes "0x", "+", "_": only plain hex digits are a chunk size.
                if not size_text or size_text.lstrip(_HEX_DIGITS) or len(size_text) > 16:
                    raise ChunkedError(f"bad chunk size {bytes(line[:40])!r}")
                size = int(size_text, 16)
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._remaining = size
                    self._state = _DATA
        if pos < n:
            self._buf = data[pos:]
        return pieces
