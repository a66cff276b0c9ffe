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

A connection closed while a request is still arriving (after a 408 or 431, or a body too slow)
lingers: the server sends its answer and the end of its side (a TCP half-close), and reads and
drops what the client still sends, :data:`LINGER_BYTES` for :data:`LINGER_S` at most, before it
closes. Closed at once, with input unread or still coming, the connection is reset, and a client
that sends its whole request before it reads (as most do) met the reset before the answer.

The protocol is uvicorn's internals, which any release may change: the ``[serve]`` extra takes the
releases this is tested with (:data:`UVICORN`), and importing this module checks that what it uses
of the protocol is there (:func:`check_internals`), so that another uvicorn fails at once, naming
what it lacks, rather than as connections come.
"""

from __future__ import annotations

import asyncio
import inspect
import json

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

# The uvicorn releases lik-cupy is tested with (pyproject.toml's [serve] extra): from the one CI
# runs to the next minor release, since uvicorn, before 1.0, may change its internals in any.
UVICORN = ">=0.54,<0.55"

# A request's line and headers, at most: a client of the protocol sends a few hundred bytes.
MAX_HEADER_BYTES = 64 << 10
# The ASGI scope's extension by which the application drops a connection whose client stopped
# taking its answer: transport.close() would wait for the answer to be taken first.
ABORT = "lik_cupy.abort"
# What a lingering connection reads and drops, at most, and for how long: the rest of a request
# that its client sends before it reads the answer (a refused one is at most a body, sent slowly,
# or headers over 64 KiB), bounded so that a client sending without end is closed all the same.
LINGER_BYTES = 1 << 20
LINGER_S = 2.0


# What Connection uses of uvicorn's protocol: the methods it extends; the attributes it reads of a
# protocol, of a request's cycle and of the server's state.
_EXTENDED = ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_headers_complete",
             "on_message_complete", "on_response_complete")
_READ = ("transport", "loop", "pipeline", "cycle", "scope", "server_state")
_CYCLE_READ = ("response_complete",)
_STATE_READ = ("default_headers",)


def missing_internals(protocol: type = HttpToolsProtocol) -> list[str]:
    """What :class:`Connection` uses of uvicorn's httptools protocol that ``protocol`` (that class,
    or a stand-in) lacks, by name: its methods, then the attributes of one made as uvicorn makes it
    (for this check only: it serves nothing), of a request's cycle and of the server's state."""
    name = protocol.__name__
    missing = [f"{name}.{m}" for m in _EXTENDED if not callable(getattr(protocol, m, None))]
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(_no_app, log_config=None, lifespan="off", ws="none")
        made = protocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    except Exception as e:  # noqa: BLE001 - named, as a missing attribute is
        return [*missing, f"{name}(config, server_state, app_state, _loop) ({type(e).__name__}: {e})"]
    finally:
        loop.close()
    missing += [f"{name}.{a}" for a in _READ if not hasattr(made, a)]
    cycle = getattr(httptools_impl, "RequestResponseCycle", None)
    if cycle is None:
        return [*missing, "httptools_impl.RequestResponseCycle"]
    try:  # (its constructor only keeps what it is given)
        one = cycle(**dict.fromkeys(inspect.signature(cycle).parameters))
    except Exception as e:  # noqa: BLE001
        return [*missing, f"RequestResponseCycle(...) ({type(e).__name__}: {e})"]
    missing += [f"RequestResponseCycle.{a}" for a in _CYCLE_READ if not hasattr(one, a)]
    return missing + [f"ServerState.{a}" for a in _STATE_READ if not hasattr(made.server_state, a)]


def check_internals(protocol: type = HttpToolsProtocol) -> None:
    """ImportError naming what :func:`missing_internals` finds, the uvicorn installed and the
    releases tested (:data:`UVICORN`); nothing where all is there."""
    missing = missing_internals(protocol)
    if missing:
        raise ImportError(f"lik serve's HTTP connections extend uvicorn's httptools protocol, and uvicorn "
                          f"{uvicorn.__version__}'s lacks {', '.join(missing)}; lik-cupy is tested with "
                          f"uvicorn{UVICORN}")


async def _no_app(scope, receive, send) -> None:
    """The application of :func:`missing_internals`' protocol, which serves nothing."""


def connection_class(header_timeout: float) -> type:
    """The protocol class of a server whose requests' headers must arrive within ``header_timeout``
    seconds (uvicorn's ``Config(http=...)``)."""
    return type("Connection", (Connection,), {"header_timeout": header_timeout})


class Connection(HttpToolsProtocol):
    """uvicorn's protocol with a timer on each request's headers and a bound on their size."""

    header_timeout = 10.0

    def connection_made(self, transport) -> None:
        self._header_timer = self._linger_timer = None
        self._in_headers, self._begun, self._header_bytes = True, False, 0
        self._lingering = None  # (the bytes it may still drop, once it lingers)
        self._socket = transport
        super().connection_made(_Transport(transport, self))
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # (dropped, unparsed)
            self._lingering -= len(data)
            if self._lingering < 0:
                self._socket.close()
            return
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
        self.scope.setdefault("extensions", {})[ABORT] = self.transport.abort  # (before the request's task runs)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers, self._begun = True, False

    def on_response_complete(self) -> None:
        waiting = not self.pipeline  # (a request whose headers have all arrived is queued there)
        super().on_response_complete()
        if waiting and not self.transport.is_closing():
            self._arm()  # the next request's headers (and the rest of this one's body, if any)

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

    def _close(self) -> None:
        """Close the connection (uvicorn's ``transport.close()`` and ours): lingering where a request
        is still arriving and its answer, if any, has been sent; at once otherwise."""
        if self._lingering is not None:
            return  # (its bounds close it)
        answered = self.cycle is None or self.cycle.response_complete
        if self._begun and answered and not self._socket.is_closing() and self._socket.can_write_eof():
            self._disarm()
            self._lingering = LINGER_BYTES
            self._socket.write_eof()  # (once what is written has gone)
            self._socket.resume_reading()  # (uvicorn pauses it while a body waits to be read)
            self._linger_timer = self.loop.call_later(LINGER_S, self._socket.close)
        else:
            self._socket.close()


class _Transport:
    """A connection's transport as uvicorn holds it (the protocol's and each request's): asyncio's,
    but closing it is :meth:`Connection._close`, and it is closing once the connection lingers."""

    def __init__(self, transport, connection: Connection):
        self._transport, self._connection = transport, connection

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        self._connection._close()

    def is_closing(self) -> bool:
        return self._connection._lingering is not None or self._transport.is_closing()


_PHRASES = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


check_internals()
