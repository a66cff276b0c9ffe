"""Tensors of the Open Inference Protocol (KServe v2) over HTTP: a request's inputs from JSON or from
the binary tensor extension, and a response's outputs back.

The binary extension: the body is a JSON header of ``Inference-Header-Content-Length`` bytes, then
each input that names a ``binary_data_size`` parameter, in input order, as raw little-endian bytes
(BYTES elements each as a 4-byte little-endian length and the bytes). Responses do the same for the
outputs asked for in binary (``binary_data_output`` for all, unless an output's own ``binary_data``
says otherwise).
Every malformed part raises ``ValueError`` naming it.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
import threading

import numpy as np

from .._shard_format import numpy_dtype

DTYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
          "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FP16": "float16",
          "FP32": "float32", "FP64": "float64", "BF16": "bfloat16"}
DATATYPES = {v: k for k, v in DTYPES.items()}
_DATATYPE_OF = {np.dtype(v): k for k, v in DTYPES.items() if v != "bfloat16"}  # str(dtype) costs microseconds
MAX_ELEMENTS = 1 << 28  # per input: a header cannot ask for more than this
# BYTES inputs become fixed-width NumPy strings, each element padded to the longest at 4 bytes a
# character: one long element among many empty ones would otherwise ask for thousands of times its bytes.
MAX_STRING_BYTES = 1 << 26
_DIGITS = re.compile(r"[0-9]+")


def read_request(body: bytes, header_length: str | None) -> tuple[dict, dict[str, np.ndarray]]:
    """(the request's JSON header, its inputs by name). The header may be one returned before for
    the same header bytes (:data:`_PLANS`): read it, never change it."""
    if header_length is None:
        header, binary = _json(body), b""
    else:
        if not _DIGITS.fullmatch(header_length):  # (int() would take " 5", "+5" and "1_0")
            raise ValueError(f"Inference-Header-Content-Length must be an integer, got {header_length!r}")
        n = int(header_length)
        if not 0 <= n <= len(body):
            raise ValueError(f"Inference-Header-Content-Length is {n} but the body has {len(body)} bytes")
        key = body[:n] if n <= _PLAN_KEY_BYTES else None
        plan = None if key is None else _PLANS.get(key)
        binary = memoryview(body)[n:]
        if plan is not None and plan[2] == len(binary):
            header, specs, _ = plan
            return header, {name: np.frombuffer(binary[at:at + size], dt).reshape(shape)
                            for name, at, size, dt, shape in specs}
        header = _json(body[:n])
        header_inputs = _inputs(header, binary)
        if key is not None and all(spec is not None for spec in header_inputs[1]):
            _keep(_PLANS, key, (header, header_inputs[1], len(binary)))
        return header, header_inputs[0]
    return header, _inputs(header, binary)[0]


# Parsed binary-request headers by their bytes: a client sends the same header for every request of
# one shape, and parsing and checking it took 59 us of a lone rerank on an H200 host (9 timed alone:
# the server's code runs with cold caches). An entry is (the header, each input's (name, offset,
# size, dtype, shape), the binary bytes it describes).
_PLANS: dict[bytes, tuple] = {}
_CACHES_LOCK = threading.Lock()  # (this cache's and _OUTPUTS_JSON's inserts)
_PLANS_MAX = 256  # entries of each cache
_PLAN_KEY_BYTES = 4096


def _keep(cache: dict, key, value) -> None:
    """``cache[key] = value`` in one of this module's caches, the oldest entry dropped past ``_PLANS_MAX``."""
    with _CACHES_LOCK:
        if len(cache) >= _PLANS_MAX:
            del cache[next(iter(cache))]
        cache[key] = value


def _inputs(header, binary) -> tuple[dict[str, np.ndarray], list]:
    """(the inputs by name, each one's cache spec, or None where its bytes are not read as they lie:
    JSON data or BYTES)."""
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise ValueError("the request must be a JSON object with an 'inputs' list")
    inputs, specs, at = {}, [], 0
    for i, t in enumerate(header["inputs"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ValueError(f"input {i} must be an object with a 'name'")
        name, datatype = t["name"], t.get("datatype")
        shape = check_input(inputs, name, t.get("shape"), datatype)
        params = t.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValueError(f"input {name}: parameters must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"input {name}: binary_data_size must be a non-negative integer, got {size!r}")
            if at + size > len(binary):
                raise ValueError(f"input {name}: binary_data_size {size} runs past the {len(binary)} bytes of "
                                 f"binary data after the header (from byte {at})")
            inputs[name] = a = tensor_from_bytes(name, binary[at:at + size], shape, datatype)
            specs.append(None if datatype == "BYTES" else (name, at, size, a.dtype, shape))
            at += size
        elif "data" in t:
            inputs[name] = tensor_from_values(name, t["data"], shape, datatype)
            specs.append(None)
        else:
            raise ValueError(f"input {name} has neither 'data' nor a binary_data_size parameter")
    if at != len(binary):
        raise ValueError(f"the body has {len(binary) - at} bytes of binary data that no input's binary_data_size "
                         f"accounts for")
    return inputs, specs


def write_response(header: dict, outputs: list[tuple[str, np.ndarray]], binary: set[str]) -> tuple[bytes, int | None]:
    """(the body, its JSON header's length when some output is binary, else None): ``header`` (the
    response's fields) with ``outputs`` added, those named in ``binary`` as raw bytes after it."""
    if outputs and all(name in binary for name, _ in outputs):
        # Every output binary: their JSON depends on names, types, shapes and sizes alone (cached).
        chunks = [tensor_bytes(a) for _, a in outputs]
        key = tuple((name, a.dtype, a.shape, len(raw)) for (name, a), raw in zip(outputs, chunks))
        tail = _OUTPUTS_JSON.get(key)
        if tail is None:
            tail = json.dumps([_tensor_json(name, a, raw) for (name, a), raw in zip(outputs, chunks)])
            _keep(_OUTPUTS_JSON, key, tail)
        text = json.dumps(header, allow_nan=True)[:-1]
        text = f'{text}{", " if header else ""}"outputs": {tail}}}'.encode()
        return b"".join([text, *chunks]), len(text)
    tensors, chunks = [], []
    for name, a in outputs:
        raw = tensor_bytes(a) if name in binary else None
        t = _tensor_json(name, a, raw)
        if raw is not None:
            chunks.append(raw)
        else:
            t["data"] = [_text(x) for x in a.reshape(-1)] if t["datatype"] == "BYTES" else a.reshape(-1).tolist()
        tensors.append(t)
    text = json.dumps({**header, "outputs": tensors}, allow_nan=True).encode()
    if not chunks:
        return text, None
    return b"".join([text, *chunks]), len(text)


def _tensor_json(name: str, a: np.ndarray, raw: bytes | None) -> dict:
    """An output's entry in the response header; with its ``raw`` bytes when they follow the header."""
    t = {"name": name, "datatype": _datatype(a), "shape": list(a.shape)}
    if raw is not None:
        t["parameters"] = {"binary_data_size": len(raw)}
    return t


_OUTPUTS_JSON: dict[tuple, str] = {}  # write_response's outputs, all binary, by (name, dtype, shape, bytes)


def _datatype(a: np.ndarray) -> str:
    return "BYTES" if a.dtype.kind in "US" else _DATATYPE_OF.get(a.dtype) or DATATYPES[str(a.dtype)]


def binary_outputs(header: dict, names: tuple[str, ...]) -> tuple[list[str], set[str]]:
    """(the outputs to send, in ``names`` order; those to send as binary) as the request asks."""
    params = header.get("parameters") or {}
    every = isinstance(params, dict) and _flag(params, "binary_data_output")
    asked = header.get("outputs")
    if asked is None or asked == []:  # (none named: all, as Triton and gRPC, which cannot tell them apart)
        return list(names), set(names) if every else set()
    if not isinstance(asked, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in asked):
        raise ValueError("'outputs' must be a list of objects with a 'name'")
    wanted, binary = [], set()
    for o in asked:
        if o["name"] not in names:
            raise ValueError(f"unknown output {o['name']!r}; this model has {', '.join(names)}")
        wanted.append(o["name"])
        p = o.get("parameters") or {}
        if not isinstance(p, dict):
            raise ValueError(f"output {o['name']}: 'parameters' must be an object")
        if _flag(p, "binary_data") if "binary_data" in p else every:  # (an output's own flag overrides)
            binary.add(o["name"])
    return [n for n in names if n in wanted], binary


def _flag(params: dict, key: str) -> bool:
    """A boolean parameter (absent: false); a string such as "false" is refused, not read as true."""
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"parameter {key!r} must be true or false, got {value!r}")
    return value


def _json(raw) -> object:
    try:
        return json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the request header is not JSON: {e}") from None
    except RecursionError:
        raise ValueError("the request header nests its JSON too deeply") from None


def check_input(inputs: dict, name: str, shape, datatype) -> tuple[int, ...]:
    """An input's shape, checked with its datatype and against the ``inputs`` read before it."""
    if name in inputs:
        raise ValueError(f"input {name} is given twice")
    shape = tensor_shape(name, shape)
    if not isinstance(datatype, str) or datatype != "BYTES" and datatype not in DTYPES:  # (a list: unhashable)
        raise ValueError(f"input {name} has datatype {datatype!r}; expected one of {', '.join(DTYPES)} or BYTES")
    return shape


def tensor_shape(name: str, shape) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise ValueError(f"input {name}: shape must be a list of non-negative integers, got {shape!r}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f"input {name}: shape {shape} has more than {MAX_ELEMENTS} elements")
    return tuple(shape)


def tensor_from_bytes(name: str, raw: memoryview, shape: tuple[int, ...], datatype: str) -> np.ndarray:
    """An input of ``shape`` and ``datatype`` from its raw bytes (a view of them where it can)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        # At most the shape's elements are read: empty elements are 4 bytes each, and a body of
        # them behind a small shape cost a Python step each (16M for a 64 MiB body) before the count
        # was compared.
        items, at = [], 0
        while at < len(raw) and len(items) < count:
            if at + 4 > len(raw):
                raise ValueError(f"input {name}: BYTES element {len(items)} has a truncated length prefix")
            (n,) = struct.unpack_from("<I", raw, at)
            if at + 4 + n > len(raw):
                raise ValueError(f"input {name}: BYTES element {len(items)} of {n} bytes runs past its data")
            items.append(bytes(raw[at + 4:at + 4 + n]))
            at += 4 + n
        if at < len(raw):
            raise ValueError(f"input {name}: shape {list(shape)} needs {count} BYTES elements, but {len(raw) - at} "
                             f"more bytes of data follow them")
        return tensor_from_strings(name, items, shape)
    dt = numpy_dtype(DTYPES[datatype]).newbyteorder("<")
    if len(raw) != count * dt.itemsize:
        raise ValueError(f"input {name}: shape {list(shape)} of {datatype} is {count * dt.itemsize} bytes, but "
                         f"its data has {len(raw)}")
    return np.frombuffer(raw, dt).reshape(shape)


def tensor_from_values(name: str, data, shape: tuple[int, ...], datatype: str) -> np.ndarray:
    """An input of ``shape`` and ``datatype`` from a (nested) list of numbers, or of strings for BYTES."""
    count = math.prod(shape)
    flat = _flatten(data)
    if len(flat) != count:
        raise ValueError(f"input {name}: shape {list(shape)} needs {count} values, got {len(flat)}")
    if datatype == "BYTES":
        if not all(isinstance(x, str) for x in flat):
            raise ValueError(f"input {name}: BYTES data must be strings")
        return _strings(name, [x.encode() for x in flat]).reshape(shape)
    # JSON's numbers as the datatype takes them: no float for an integer (an id of 1000.9 was read as
    # 1000), no true or false for a number (read as 1 and 0), only true and false for BOOL.
    if datatype == "BOOL":
        ok, what = all(isinstance(x, bool) for x in flat), "true or false"
    elif datatype.startswith(("INT", "UINT")):
        ok, what = all(isinstance(x, int) and not isinstance(x, bool) for x in flat), "integers"
    else:
        ok, what = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat), "numbers"
    if not ok:
        raise ValueError(f"input {name}: {datatype} data must be {what}")
    dt = numpy_dtype(DTYPES[datatype])
    try:
        if datatype == "BF16":  # (ml_dtypes takes no integer past int64's range, 10**30; float64 rounds it alike)
            return np.asarray(flat, np.float64).astype(dt).reshape(shape)
        return np.asarray(flat, dtype=dt).reshape(shape)
    except OverflowError:
        raise ValueError(f"input {name}: a value does not fit {datatype}") from None


def tensor_from_strings(name: str, items: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    """A BYTES input of ``shape`` from its elements (UTF-8 text each)."""
    count = math.prod(shape)
    if len(items) != count:
        raise ValueError(f"input {name}: shape {list(shape)} needs {count} BYTES elements, got {len(items)}")
    return _strings(name, items).reshape(shape)


def tensor_bytes(a: np.ndarray) -> bytes:
    """An output's raw bytes: little-endian elements, BYTES as 4-byte lengths and the UTF-8 text."""
    if a.dtype.kind in "US":
        return _bytes_elements(a)
    if a.dtype.byteorder in _LITTLE:
        return a.tobytes()  # (C order)
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


_LITTLE = ("<", "|") + (("=",) if sys.byteorder == "little" else ())


def _flatten(data) -> list:
    """The values of nested lists in order, without recursion (however deep the JSON nests)."""
    if not isinstance(data, list):
        return [data]
    out, stack = [], [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out


def _strings(name: str, items: list[bytes]) -> np.ndarray:
    try:
        text = [b.decode() for b in items]
    except UnicodeDecodeError:
        raise ValueError(f"input {name}: BYTES elements must be UTF-8 text") from None
    if any("\x00" in t for t in text):  # (NumPy's strings drop trailing NULs: "doc1\0" would be doc1)
        raise ValueError(f"input {name}: a BYTES element holds a NUL, which no id holds")
    width = max(map(len, text), default=0)
    if len(text) * width * 4 > MAX_STRING_BYTES:
        raise ValueError(f"input {name}: {len(text)} BYTES elements of up to {width} characters take "
                         f"{len(text) * width * 4} bytes as an array (each padded to the longest); at most "
                         f"{MAX_STRING_BYTES}")
    return np.array(text, dtype=str)


def _bytes_elements(a: np.ndarray) -> bytes:
    parts = []
    for x in a.reshape(-1):
        b = x if isinstance(x, bytes) else str(x).encode()  # (str() of a byte string is its repr: "b'doc1'")
        parts += [struct.pack("<I", len(b)), b]
    return b"".join(parts)


def _text(x) -> str:
    """A BYTES output's element as JSON text: byte-string ids (ids.npy of dtype S) decoded as UTF-8,
    as lik's results show them."""
    return x.decode("utf-8", errors="backslashreplace") if isinstance(x, bytes) else str(x)
