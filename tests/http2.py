"""A raw HTTP/2 connection to ``lik serve``'s gRPC port (the tests' shared helper), for clients that
grpcio's own would never be: one that opens more calls than the server allows, or one that opens
none, or one that sends part of a message. Frames are written by hand; a call's headers are literal
HPACK fields (neither indexed nor Huffman-coded), which every decoder takes, and the server's are
read as grpc core writes them (:func:`fields`)."""

from __future__ import annotations

import socket
import time

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, ACK, END_HEADERS = 1, 1, 4
MAX_CONCURRENT_STREAMS = 3  # (a SETTINGS parameter)
REFUSED_STREAM = 7  # (an RST_STREAM error code)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int = 0, stream: int = 0, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def call_headers(method: str) -> bytes:
    """The header block of a call of ``inference.GRPCInferenceService/METHOD``."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", f"/inference.GRPCInferenceService/{method}"),
              (":authority", "lik"), ("content-type", "application/grpc"), ("te", "trailers")]
    return b"".join(b"\x00" + bytes([len(n)]) + n.encode() + bytes([len(v)]) + v.encode() for n, v in fields)


def _integer(block: bytes, at: int, bits: int) -> tuple[int, int]:
    """(the HPACK integer of a ``bits``-bit prefix at byte ``at``, the byte after it)."""
    mask = (1 << bits) - 1
    value, at = block[at] & mask, at + 1
    shift = 0
    while value >= mask:  # (then 7 bits a byte, while the high bit is set)
        b, at = block[at], at + 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    return value, at


def _string(block: bytes, at: int) -> tuple[str, int]:
    assert not block[at] & 0x80, "a Huffman-coded HPACK string (grpc core writes none here)"
    n, at = _integer(block, at, 7)
    return block[at:at + n].decode(), at + n


_STATIC = {8: (":status", "200")}  # (the one entry of HPACK's static table that grpc core sends here)


def fields(block: bytes, table: list) -> dict[str, str]:
    """The header fields of an HPACK ``block`` as grpc core writes them (literal strings, indexed
    fields of the static ``:status`` or of ``table``, the connection's dynamic table, which this
    updates: decode every block of a connection, in order)."""
    out, at = {}, 0
    while at < len(block):
        b = block[at]
        if b & 0x80:  # an indexed field
            index, at = _integer(block, at, 7)
            name, value = _STATIC[index] if index in _STATIC else table[index - 62]
        elif b & 0xE0 == 0x20:  # a dynamic table size update
            at = _integer(block, at, 5)[1]
            continue
        else:  # a literal: with incremental indexing (0x40), or without (0x00, 0x10)
            indexing = b & 0x40
            index, at = _integer(block, at, 6 if indexing else 4)
            name = table[index - 62][0] if index else None
            if name is None:
                name, at = _string(block, at)
            value, at = _string(block, at)
            if indexing:
                table.insert(0, (name, value))
        out[name] = value
    return out


class Connection:
    """A connection to ``127.0.0.1:port`` that has sent the client's preface and an empty SETTINGS
    frame; :meth:`settings` reads the server's and acknowledges them."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(PREFACE + frame(SETTINGS))
        self._buffer = b""
        self._table: list = []  # (HPACK's dynamic table of the server's header blocks)

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def read(self, timeout: float = 60) -> tuple[int, int, int, bytes] | None:
        """The next frame as (kind, flags, stream, payload); None once the server has closed the
        connection. AssertionError when none comes within ``timeout`` seconds."""
        until = time.monotonic() + timeout
        while len(self._buffer) < 9 or len(self._buffer) < 9 + int.from_bytes(self._buffer[:3], "big"):
            left = until - time.monotonic()
            assert left > 0, f"no HTTP/2 frame from the server within {timeout} s"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            except TimeoutError:
                continue
            if not data:
                return None
            self._buffer += data
        n = int.from_bytes(self._buffer[:3], "big")
        head, payload, self._buffer = self._buffer[:9], self._buffer[9:9 + n], self._buffer[9 + n:]
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload

    def settings(self, timeout: float = 60) -> dict[int, int]:
        """The server's SETTINGS (parameter: value), once acknowledged (the frames before it are dropped)."""
        while True:
            f = self.read(timeout)
            assert f is not None, "the server closed the connection before its SETTINGS"
            kind, flags, _, payload = f
            if kind == SETTINGS and not flags & ACK:
                self.send(frame(SETTINGS, ACK))
                return {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                        for i in range(0, len(payload), 6)}

    def trailers(self, streams, timeout: float = 60) -> dict[int, dict[str, str]]:
        """The fields that end each of ``streams`` (a call's trailers: ``grpc-status`` and
        ``grpc-message``), {stream: {"reset": code}} for one reset, as they come; pings are answered.
        AssertionError when one has not ended within ``timeout`` seconds, or the server closes the
        connection first."""
        ended = {}
        until = time.monotonic() + timeout
        while set(streams) - set(ended):
            f = self.read(max(0.0, until - time.monotonic()))
            assert f is not None, f"the server closed the connection; streams ended so far: {ended}"
            kind, flags, stream, payload = f
            if kind == HEADERS:
                assert flags & END_HEADERS, "a header block in CONTINUATION frames"
                got = fields(payload, self._table)  # (every block, in order: they share the table)
                if flags & END_STREAM:
                    ended[stream] = got
            elif kind == PING and not flags & ACK:  # (grpc core ends the calls of a client that does not answer)
                self.send(frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM:  # (after a stream's trailers: the rest of its request is not read)
                ended.setdefault(stream, {"reset": int.from_bytes(payload, "big")})
        return ended

    def close(self) -> None:
        self.sock.close()
