"""``lik serve`` whose reading of a large request, and writing of a large answer, wait for the test:
``python tests/parse_served.py FLAG ARGS --port P``, ARGS as ``lik serve`` takes them. The parse of
an HTTP body or a gRPC message over 1 MiB, the inflating of a compressed body over 1 MiB, and the
writing of an HTTP answer of over 100,000 JSON values, print ``parse_served: parsing`` (or
``writing``) to stderr as they start, then wait until the file FLAG exists (20 s at most) before
they go on; smaller ones are done as in ``lik serve``. The tests of a request answered while a
large one is read or answered hold the large one there, for as long as they need. The server's
``Service.stop`` (its queues closing, as it stops) prints ``parse_served: stopping`` first, with
`` while parsing`` where a parse is held then."""

from __future__ import annotations

import os
import sys
import time

from lik_cupy import cli
from lik_cupy.serving import _service, _tensors, http

LARGE = 1 << 20
_holding = []  # (the parses held now)


def held(read, large, what="parsing"):
    """``read``, waiting for FLAG first where ``large(*args, **kwargs)`` says its call is large."""
    flag = sys.argv[1]

    def read_when_let(*args, **kwargs):
        if large(*args, **kwargs):
            print(f"parse_served: {what}", file=sys.stderr, flush=True)
            _holding.append(what)
            until = time.monotonic() + 20
            while not os.path.exists(flag) and time.monotonic() < until:
                time.sleep(0.01)
            _holding.remove(what)
        return read(*args, **kwargs)

    return read_when_let


def said(stop):
    def stop_and_say(svc):
        print(f"parse_served: stopping{' while parsing' if 'parsing' in _holding else ''}", file=sys.stderr, flush=True)
        stop(svc)

    return stop_and_say


def main() -> None:
    # (not the calls that give up early on a large request: most=, or an inflating limit of less)
    _tensors.read_request = held(_tensors.read_request,
                                 lambda body, *args, most=None, **kwargs: len(body) > LARGE and most is None)
    http._decoded = held(http._decoded, lambda body, coding, limit: len(body) > LARGE and limit > LARGE)
    _tensors.write_response = held(_tensors.write_response, lambda header, outputs, binary:
                                   sum(a.size for name, a in outputs if name not in binary) > 100_000, "writing")
    _service.Service.stop = said(_service.Service.stop)
    try:
        from lik_cupy.serving import grpc
    except ImportError:  # (no [serve-grpc] extra: HTTP only)
        pass
    else:
        grpc._request = held(grpc._request, lambda request, *args: request.ByteSize() > LARGE)
    cli.main(["serve", *sys.argv[2:]], prog_name="lik")


if __name__ == "__main__":
    main()
