"""A raw HTTP/2 connection to ``lik serve``'s gRPC port (the tests' shared helper), for clients that
grpcio's own would never be: one that opens more calls than the server allows, or one that opens
none. Frames are written by hand; a call's headers are literal HPACK fields (neither indexed nor
Huffman-coded), which every decoder takes."""

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


class Connection:
    """A connection to ``127.0.0.1:port`` that has sent the client's preface and an empty SETTINGS
    frame; :meth:`settings` reads the server's and acknowledges them."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(PREFACE + frame(SETTINGS))
        self._buffer = b""

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

    def close(self) -> None:
        self.sock.close()
