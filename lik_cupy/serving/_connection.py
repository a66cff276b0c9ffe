"""An HTTP connection of ``lik serve``: uvicorn's httptools protocol with the limits it lacks on a
request's headers, and the server-wide cap on connections. uvicorn times only an idle connection
after an answer (its keep-alive timeout, 5 s, which any byte puts off), and httptools takes headers
of any size: a connection that never finished its headers was held for as long as its client stayed
connected, and one that sent header lines without end grew the server by all of them (to 22 GB,
over loopback).

Here a request's headers must all arrive within the server's ``header_timeout`` of the connection
opening or of the previous answer (or else the connection closes: 408 where part of a request had
arrived), and take at most :data:`MAX_HEADER_BYTES` (431, and the connection closes). A request
that comes while more than the server's ``max_connections`` are open, its own among them, or while
as many requests are running, is answered 503 and its connection closed (as uvicorn's
``limit_concurrency`` refused, in plain text and uncounted). Each refusal is reported to the
server's ``refused(status, reason)`` (its metrics). A request's body, and a large answer, are the
application's to time (``_service.BodyClock``): its scope's extension :data:`ABORT` drops the
connection of a client that stopped taking its answer.

uvicorn writes a response's status line and headers as soon as the application starts it, and its
body after: two sends, which a client at low load woke for twice to read one small answer. The
extension :data:`JOIN` has the next write (the status line and headers) wait and go out with the one
after it (the body), in one send. The extension :data:`LOST` calls the application back when its
client goes away, where a task of its own waiting for ``http.disconnect`` cost a queued request
about 15 us at low load (the worker's wake-up waited for the event loop to start that task).

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
# The ASGI scope's extension (a callable of no arguments) by which the application joins the
# response it is about to start with the first piece of its body, in one write (the module docstring).
JOIN = "lik_cupy.join"
# The ASGI scope's extension by which the application hears that the connection is lost:
# ``watch(callback)`` has it call ``callback()`` (no arguments) once, when it is lost (soon, from the
# event loop, where it already is), until ``watch(None)``. One request of a connection at a time watches.
LOST = "lik_cupy.lost"
# What a lingering connection reads and drops, at most, and for how long: the rest of a request
# that its client sends before it reads the answer (a refused one is at most a body, sent slowly,
# or headers over 64 KiB), bounded so that a client sending without end is closed all the same.
LINGER_BYTES = 1 << 20
LINGER_S = 2.0


# What Connection uses of uvicorn's protocol: the methods it extends; the attributes it reads of a
# protocol, of a request's cycle and of the server's state.
_EXTENDED = ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_headers_complete",
             "on_message_complete", "on_response_complete")
_READ = ("transport", "loop", "pipeline", "cycle", "scope", "server_state", "flow", "app", "connections", "tasks")
_CYCLE_READ = ("response_complete", "transport")
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


def connection_class(header_timeout: float, max_connections: int | None = None, refused=None) -> type:
    """The protocol class of a server whose requests' headers must arrive within ``header_timeout``
    seconds, that serves ``max_connections`` connections at once (None: any number), and that counts
    its refusals by ``refused(status, reason)`` (uvicorn's ``Config(http=...)``)."""
    return type("Connection", (Connection,), {"header_timeout": header_timeout, "max_connections": max_connections,
                                              "refused": staticmethod(refused or _uncounted)})


def _uncounted(status: int, reason: str) -> None:
    """The ``refused`` of a server that counts nothing."""


class Connection(HttpToolsProtocol):
    """uvicorn's protocol with a timer on each request's headers, a bound on their size, and the cap
    on connections."""

    header_timeout = 10.0
    max_connections = None
    refused = staticmethod(_uncounted)

    def connection_made(self, transport) -> None:
        self._header_timer = self._linger_timer = None
        self._in_headers, self._begun, self._header_bytes = True, False, 0
        self._lingering = None  # (the bytes it may still drop, once it lingers)
        self._socket = transport
        wrapped = _Transport(transport, self)
        self._joining = _Joining(wrapped)  # (its requests' cycles write here: closing it still lingers)
        self._on_lost, self._lost = None, False
        super().connection_made(wrapped)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._lost = True
        super().connection_lost(exc)
        self._call_lost()

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
            self._refuse(431, f"the request's line and headers take over {MAX_HEADER_BYTES} bytes", "header_size")

    def on_message_begin(self) -> None:
        self._begun = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_headers, self._header_bytes = False, 0
        extensions = self.scope.setdefault("extensions", {})  # (before the request's task runs)
        extensions[ABORT], extensions[JOIN], extensions[LOST] = self.transport.abort, self._joining.hold, self._watch
        cap = self.max_connections
        if cap is not None and (len(self.connections) > cap or len(self.tasks) > cap):
            # (the connections open count this one: uvicorn's limit_concurrency, given cap + 1, refused so)
            app, self.app = self.app, self._over_cap  # (the request's task runs self.app)
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        if self.cycle is not None:  # (None where an upgrade took the first request)
            self.cycle.transport = self._joining  # (the cycles of one connection write one after another)

    async def _over_cap(self, scope, receive, send) -> None:
        """The application of a request that came over the cap: 503, and the connection closes."""
        self.refused(503, "max_connections")
        body = json.dumps({"error": f"the server serves {self.max_connections} connections at once, and more are "
                                    f"open; retry later"}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                (b"connection", b"close"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

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
            self._refuse(408, f"the request's headers had not all arrived after {self.header_timeout:g} s",
                         "header_timeout")
        else:  # (nothing of a request had arrived, or only the rest of a body already answered)
            self.transport.close()

    def _refuse(self, status: int, message: str, reason: str) -> None:
        """Answer ``status`` with the protocol's JSON error where no answer is being sent on this
        connection, and close it; counted for ``reason`` (where answered)."""
        self._disarm()
        if self.cycle is None or self.cycle.response_complete:
            self.refused(status, reason)
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


check_internals()
