"""An HTTP connection of ``lik serve``: uvicorn's httptools protocol with the limits it lacks on a
request's headers. uvicorn times only an idle connection after an answer (its keep-alive timeout,
5 s, which any byte puts off), and httptools takes headers of any size: a connection that never
finished its headers was held for as long as its client stayed connected, and one that sent header
lines without end grew the server by all of them (to 22 GB, over loopback).

Here a request's headers must all arrive within the server's ``header_timeout`` of the connection
opening or of the previous answer (or else the connection closes: 408 where part of a request had
arrived), and take at most :data:`MAX_HEADER_BYTES` (431, and the connection closes). A request's
body, and a large answer, are the application's to time (``_service.BodyClock``): its scope's
extension :data:`ABORT` drops the connection of a client that stopped taking its answer.

uvicorn writes a response's status line and headers as soon as the application starts it, and its
body after: two sends, which a client at low load woke for twice to read one small answer. The
extension :data:`JOIN` has the next write (the status line and headers) wait and go out with the one
after it (the body), in one send. The extension :data:`LOST` calls the application back when its
client goes away, where a task of its own waiting for ``http.disconnect`` cost a queued request
about 15 us at low load (the worker's wake-up waited for the event loop to start that task).
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# A request's line and headers, at most: a client of the protocol sends a few hundred bytes.
MAX_HEADER_BYTES = 64 << 10
# The ASGI scope's extension by which the application drops a connection whose client stopped
# taking its answer: transport.close() would wait for the answer to be taken first.
ABORT = "lik_cupy.abort"
# The ASGI scope's extension (a callable of no arguments) by which the application joins the
# response it is about to start with the first piece of its body, in one write (the module docstring).
JOIN = "lik_cupy.join"
# The ASGI scope's extension by which the application hears that the connection is lost:
# ``watch(callback)`` has it call ``callback()`` (no arguments) once, when it is lost (soon, from the
# event loop, where it already is), until ``watch(None)``. One request of a connection at a time watches.
LOST = "lik_cupy.lost"


def connection_class(header_timeout: float) -> type:
    """The protocol class of a server whose requests' headers must arrive within ``header_timeout``
    seconds (uvicorn's ``Config(http=...)``)."""
    return type("Connection", (Connection,), {"header_timeout": header_timeout})


class Connection(HttpToolsProtocol):
    """uvicorn's protocol with a timer on each request's headers and a bound on their size."""

    header_timeout = 10.0

    def connection_made(self, transport) -> None:
        self._header_timer = None
        self._in_headers, self._begun, self._header_bytes = True, False, 0
        self._joining = _Joining(transport)
        self._on_lost, self._lost = None, False
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._lost = True
        super().connection_lost(exc)
        self._call_lost()

    def data_received(self, data: bytes) -> None:
        # Counted before the parser sees them: httptools keeps a header's part until it ends, and
        # uvicorn every header. (A read is 256 KiB at most: so much more is taken before the refusal.)
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._in_headers and self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._refuse(431, f"the request's line and headers take over {MAX_HEADER_BYTES} bytes")

    def on_message_begin(self) -> None:
        self._begun = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_headers, self._header_bytes = False, 0
        extensions = self.scope.setdefault("extensions", {})  # (before the request's task runs)
        extensions[ABORT], extensions[JOIN], extensions[LOST] = self.transport.abort, self._joining.hold, self._watch
        super().on_headers_complete()
        if self.cycle is not None:  # (None where an upgrade took the first request)
            self.cycle.transport = self._joining  # (the cycles of one connection write one after another)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers, self._begun = True, False

    def on_response_complete(self) -> None:
        self._joining.flush()  # (a response without a body write: HEAD's)
        waiting = not self.pipeline  # (a request whose headers have all arrived is queued there)
        super().on_response_complete()
        if waiting and not self.transport.is_closing():
            self._arm()  # the next request's headers (and the rest of this one's body, if any)

    def _watch(self, callback) -> None:
        self._on_lost = callback
        if callback is None:
            return
        if self._lost:
            self.loop.call_soon(self._call_lost)
        else:  # (a client's leaving is seen by reading, which a body of over 64 KiB left paused)
            self.flow.resume_reading()

    def _call_lost(self) -> None:
        callback, self._on_lost = self._on_lost, None
        if callback is not None:
            callback()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._in_headers and self._begun:
            self._refuse(408, f"the request's headers had not all arrived after {self.header_timeout:g} s")
        else:  # (nothing of a request had arrived, or only the rest of a body already answered)
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with the protocol's JSON error where no answer is being sent on this
        connection, and close it."""
        self._disarm()
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps({"error": message}).encode()
            head = [f"HTTP/1.1 {status} {_PHRASES[status]}\r\n".encode()]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head.append(b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
            self.transport.write(b"".join(head) + body)
        self.transport.close()


class _Joining:
    """A connection's transport as its requests' cycles write to it: after :meth:`hold`, the next
    write waits and goes out joined with the one after it; the rest goes straight through."""

    __slots__ = ("_transport", "_hold", "_held")

    def __init__(self, transport):
        self._transport, self._hold, self._held = transport, False, None

    def hold(self) -> None:
        self._hold = True

    def write(self, data) -> None:
        if self._hold:
            self._hold, self._held = False, data
            return
        held, self._held = self._held, None
        # (a copy of the head and at most 256 KiB, _send's largest answer in one piece, for one send fewer)
        self._transport.write(data if held is None else held + data)

    def flush(self) -> None:
        """Write what is held, if anything."""
        self._hold = False
        held, self._held = self._held, None
        if held is not None:
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


_PHRASES = {408: "Request Timeout", 431: "Request Header Fields Too Large"}
