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

import contextlib
import gc
import itertools
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
_MAX_DIMS = 32  # an input's (NumPy 1's limit; no model takes an input of more than 3)


class LongParse(Exception):
    """Raised by :func:`read_request` given ``most``: the request's parse takes more than that."""


def read_request(body: bytes, header_length: str | None, most: int | None = None, yielding: bool = False,
                 hold=None) -> tuple[dict, dict[str, np.ndarray]]:
    """(the request's JSON header, its inputs by name). The header may be one returned before for
    the same header bytes (:data:`_PLANS`): read it, never change it. ``most``: raise
    :class:`LongParse`, early and having changed nothing, where the parse takes more than ``most``
    bytes of work (its JSON text, and the binary data of BYTES inputs, each element a Python step);
    ``yielding``: parse the JSON so that the GIL goes to other threads every few milliseconds (a
    number at a time), about a third slower; ``hold(nbytes)``: called with what reading the JSON
    (:func:`json_bytes`) and each BYTES input (:func:`string_bytes`, then its array) will take,
    before it is read."""
    if header_length is None:
        _within(len(body), most)
        header, binary = _json(body, yielding, hold), b""
    else:
        if not _DIGITS.fullmatch(header_length):  # (int() would take " 5", "+5" and "1_0")
            raise ValueError(f"Inference-Header-Content-Length must be an integer, got {header_length!r}")
        if len(header_length.lstrip("0")) > len(str(len(body))):  # (int() refuses past 4,300 digits)
            raise ValueError(f"Inference-Header-Content-Length has {len(header_length)} digits but the body has "
                             f"{len(body)} bytes")
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
        _within(n, most)
        header = _json(body[:n], yielding, hold)
        header_inputs = _inputs(header, binary, None if most is None else most - n, hold)
        if key is not None and all(spec is not None for spec in header_inputs[1]):
            _keep(_PLANS, key, (header, header_inputs[1], len(binary)))
        return header, header_inputs[0]
    return header, _inputs(header, binary, hold=hold)[0]


def _within(work: int, most: int | None) -> None:
    if most is not None and work > most:
        raise LongParse


def json_bytes(text: bytes) -> int:
    """At most the bytes that reading the JSON ``text`` takes in Python objects, counted from its
    punctuation: json.loads' copy of it as str and its values, each a list, a dict, a string or a
    number and its place in a list or a dict, and a list of numbers joined and made an array. A
    64 MiB body of ``[[]],`` took 2.2 GiB of values, and 9 s of the GIL to make them."""
    n = len(text)
    # (text with no escape and no byte past ASCII: str's one byte a character; else up to four, its
    # strings too)
    cost = n * (_JSON_ASCII_BYTE if text.isascii() and b"\\" not in text else _JSON_WIDE_BYTE) + _JSON_VALUE
    for mark, each in _JSON_MARKS:
        for at in range(0, n, _TEXT_CHUNK):  # (the GIL can go to another thread between chunks)
            cost += each * text.count(mark, at, at + _TEXT_CHUNK)
    return cost


def string_bytes(count: int, size: int) -> int:
    """At most the bytes that reading ``count`` BYTES elements of ``size`` bytes in all takes in Python
    objects before they become an array: a bytes and a str object each, and their places in lists."""
    return count * _STRING_ELEMENT + size * _STRING_BYTE


# Python objects (CPython 3.11, 64-bit, as pymalloc rounds them) by what stands for them in JSON
# text, with a margin; tests/test_serve_parsing.py holds json_bytes to what json.loads takes.
_JSON_VALUE = 56  # a value after each , or : (a number's object, 32 bytes, its places in lists)
_JSON_MARKS = ((b",", _JSON_VALUE), (b":", _JSON_VALUE), (b"[", 112), (b"{", 240), (b'"', 24))
_JSON_ASCII_BYTE, _JSON_WIDE_BYTE = 2, 8
_STRING_ELEMENT, _STRING_BYTE = 144, 5
_TEXT_CHUNK = 1 << 20


# Parsed binary-request headers by their bytes: a client sends the same header for every request of
# one shape, and parsing and checking it took 59 us of a lone rerank on an H200 host (9 timed alone:
# the server's code runs with cold caches). An entry is (the header, each input's (name, offset,
# size, dtype, shape), the binary bytes it describes).
_PLANS: dict[bytes, tuple] = {}
_CACHES_LOCK = threading.Lock()  # (this cache's and _OUTPUTS_JSON's inserts, and _collector_paused)
_PLANS_MAX = 256  # entries of each cache
_PLAN_KEY_BYTES = 4096


def _keep(cache: dict, key, value) -> None:
    """``cache[key] = value`` in one of this module's caches, the oldest entry dropped past ``_PLANS_MAX``."""
    with _CACHES_LOCK:
        if len(cache) >= _PLANS_MAX:
            del cache[next(iter(cache))]
        cache[key] = value


def _inputs(header, binary, most: int | None = None, hold=None) -> tuple[dict[str, np.ndarray], list]:
    """(the inputs by name, each one's cache spec, or None where its bytes are not read as they lie:
    JSON data or BYTES). ``most``: :class:`LongParse` before BYTES binary data past it is read;
    ``hold``: as :func:`read_request` takes it."""
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
            if datatype == "BYTES" and most is not None:
                most -= size
                if most < 0:
                    raise LongParse
            inputs[name] = a = tensor_from_bytes(name, binary[at:at + size], shape, datatype, hold)
            specs.append(None if datatype == "BYTES" else (name, at, size, a.dtype, shape))
            at += size
        elif "data" in t:
            inputs[name] = tensor_from_values(name, t["data"], shape, datatype, hold)
            specs.append(None)
        else:
            raise ValueError(f"input {name} has neither 'data' nor a binary_data_size parameter")
    if at != len(binary):
        raise ValueError(f"the body has {len(binary) - at} bytes of binary data that no input's binary_data_size "
                         f"accounts for")
    return inputs, specs


def write_response(header: dict, outputs: list[tuple[str, np.ndarray]],
                   binary: set[str]) -> tuple[list[bytes | memoryview], int | None]:
    """(the body in pieces, its JSON header's length when some output is binary, else None):
    ``header`` (the response's fields) with ``outputs`` added, those named in ``binary`` as raw
    bytes after it. The pieces are sent one after another, never joined: a binary output's is a
    view of its array where that is already little-endian (joining and copying a 189 MB answer held
    the event loop 0.17 s)."""
    if outputs and all(name in binary for name, _ in outputs):
        # Every output binary: their JSON depends on names, types, shapes and sizes alone (cached).
        chunks = [tensor_view(a) for _, a in outputs]
        key = tuple((name, a.dtype, a.shape, len(raw)) for (name, a), raw in zip(outputs, chunks))
        tail = _OUTPUTS_JSON.get(key)
        if tail is None:
            tail = json.dumps([_tensor_json(name, a, raw) for (name, a), raw in zip(outputs, chunks)])
            _keep(_OUTPUTS_JSON, key, tail)
        text = json.dumps(header, allow_nan=True)[:-1]
        text = f'{text}{", " if header else ""}"outputs": {tail}}}'.encode()
        return [text, *chunks], len(text)
    # json.dumps' text of {**header, "outputs": [...]}, each entry's "data" last, in pieces: a copy
    # of a large answer's text took a tenth of a second of the GIL each.
    text = json.dumps(header, allow_nan=True)[:-1]
    pieces, chunks = [f'{text}{", " if header else ""}"outputs": ['.encode()], []
    for i, (name, a) in enumerate(outputs):
        raw = tensor_view(a) if name in binary else None
        t = json.dumps(_tensor_json(name, a, raw))
        if i:
            pieces.append(b", ")
        if raw is not None:
            chunks.append(raw)
            pieces.append(t.encode())
        else:
            pieces += [f'{t[:-1]}, "data": ['.encode(), *_values_json(a), b"]}"]
    pieces.append(b"]}")
    if not chunks:
        return pieces, None
    return pieces + chunks, sum(len(p) for p in pieces)


def write_steps(outputs: list[tuple[str, np.ndarray]], binary: set[str]) -> int:
    """The values :func:`write_response` writes a Python step each: those of outputs sent as JSON,
    and BYTES elements sent binary."""
    return sum(a.size for name, a in outputs if name not in binary or a.dtype.kind in "US")


def _values_json(a: np.ndarray) -> list[bytes]:
    """An output's values as json.dumps writes them in a list, without its brackets, in pieces: a
    chunk of values at a time, so that the GIL can go to other threads between chunks (json.dumps of
    10M scores held it for seconds)."""
    flat, texts, pieces = a.reshape(-1), a.dtype.kind in "US", []
    for at in range(0, flat.size, _CHUNK // 8):
        part = flat[at:at + _CHUNK // 8]
        if at:
            pieces.append(b", ")
        pieces.append(json.dumps([_text(x) for x in part] if texts else part.tolist(), allow_nan=True)[1:-1].encode())
    return pieces


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


def _json(raw, yielding: bool = False, hold=None) -> object:
    raw = bytes(raw)
    if hold is not None:
        hold(json_bytes(raw))
    try:
        if yielding:
            # json's C parser holds the GIL for the whole text (half a second for 58 MiB of floats),
            # but calls back into Python for each number given hooks of Python's own: the
            # interpreter hands the GIL over there when another thread has waited for it. Its lists
            # and dicts set off the garbage collector, which they give nothing to (JSON makes no
            # cycles): 64 MiB of nested empty lists took 9.5 s with it, 1.4 s without.
            with _collector_paused():
                return json.loads(raw, parse_float=_float, parse_int=_int)
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the request header is not JSON: {e}") from None
    except RecursionError:
        raise ValueError("the request header nests its JSON too deeply") from None


@contextlib.contextmanager
def _collector_paused():
    """The garbage collector off meanwhile (a process-wide setting: counted, as parses of several
    servers in one process may overlap; on again after the last where it was on before the first)."""
    global _pauses, _collecting
    with _CACHES_LOCK:
        if _pauses == 0:
            _collecting = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _CACHES_LOCK:
            _pauses -= 1
            if _pauses == 0 and _collecting:
                gc.enable()


_pauses, _collecting = 0, True


def _float(text: str) -> float:
    return float(text)


def _int(text: str) -> int:
    return int(text)


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
    if len(shape) > _MAX_DIMS:  # (NumPy's own error named no input)
        raise ValueError(f"input {name}: shape has {len(shape)} dimensions; at most {_MAX_DIMS}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f"input {name}: shape {shape} has more than {MAX_ELEMENTS} elements")
    return tuple(shape)


def tensor_from_bytes(name: str, raw: memoryview, shape: tuple[int, ...], datatype: str, hold=None) -> np.ndarray:
    """An input of ``shape`` and ``datatype`` from its raw bytes (a view of them where it can);
    ``hold(nbytes)``: called with what BYTES elements will take as objects, before they are read."""
    count = math.prod(shape)
    if datatype == "BYTES":
        if hold is not None:
            hold(string_bytes(min(count, len(raw) // 4), len(raw)))
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
        return tensor_from_strings(name, items, shape, hold)
    dt = numpy_dtype(DTYPES[datatype]).newbyteorder("<")
    if len(raw) != count * dt.itemsize:
        raise ValueError(f"input {name}: shape {list(shape)} of {datatype} is {count * dt.itemsize} bytes, but "
                         f"its data has {len(raw)}")
    return np.frombuffer(raw, dt).reshape(shape)


def tensor_from_values(name: str, data, shape: tuple[int, ...], datatype: str, hold=None) -> np.ndarray:
    """An input of ``shape`` and ``datatype`` from a (nested) list of numbers, or of strings for BYTES;
    ``hold(nbytes)``: called with what BYTES elements will take as objects, before they are made."""
    count = math.prod(shape)
    flat, kinds = _flatten(data)
    if len(flat) != count:
        raise ValueError(f"input {name}: shape {list(shape)} needs {count} values, got {len(flat)}")
    # JSON's values as the datatype takes them: no float for an integer (an id of 1000.9 was read as
    # 1000), no true or false for a number (read as 1 and 0), only true and false for BOOL. The set
    # of the values' types decides at C speed (a step a value took 0.3 s for 3M floats); a set of
    # other types, or subclasses, is checked a value at a time.
    if datatype == "BYTES":
        if not kinds <= {str} and not all(isinstance(x, str) for x in flat):
            raise ValueError(f"input {name}: BYTES data must be strings")
        if hold is not None:
            hold(string_bytes(count, sum(map(len, flat))))
        try:
            items = [x.encode() for x in flat]
        except UnicodeEncodeError as e:  # (JSON's \ud800 to \udfff escape, unpaired, is no character)
            at = next(i for i, x in enumerate(flat) if x is e.object)
            raise ValueError(f"input {name}: BYTES element {at} is not text: it holds a lone surrogate "
                             f"(\\u{ord(e.object[e.start]):04x})") from None
        return _strings(name, items, hold).reshape(shape)
    if datatype == "BOOL":
        ok, what = kinds <= {bool} or all(isinstance(x, bool) for x in flat), "true or false"
    elif datatype.startswith(("INT", "UINT")):
        ok, what = kinds <= {int} or all(isinstance(x, int) and not isinstance(x, bool) for x in flat), "integers"
    else:
        ok, what = (kinds <= {int, float} or all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                  for x in flat)), "numbers"
    if not ok:
        raise ValueError(f"input {name}: {datatype} data must be {what}")
    try:
        # (ml_dtypes' BF16 takes no integer past int64's range, 10**30; float64 rounds it alike)
        return _array(flat, numpy_dtype(DTYPES[datatype]), np.float64 if datatype == "BF16" else None).reshape(shape)
    except OverflowError:
        raise ValueError(f"input {name}: a value does not fit {datatype}") from None


def tensor_from_numbers(name: str, values, shape: tuple[int, ...], datatype: str, hold=None) -> np.ndarray:
    """An input of ``shape`` and ``datatype`` from a sequence of numbers of the datatype's kind (gRPC's
    typed contents: floats for FP32 and FP64, integers for the integer types, booleans for BOOL),
    converted a chunk at a time: a list of them all took 40 bytes a value, ten times their message.
    ``hold(nbytes)``: called with its array's bytes before it is made."""
    count = math.prod(shape)
    if len(values) != count:
        raise ValueError(f"input {name}: shape {list(shape)} needs {count} values, got {len(values)}")
    dt = numpy_dtype(DTYPES[datatype])
    if hold is not None:
        hold(count * dt.itemsize)
    try:
        return _array(values, dt).reshape(shape)
    except OverflowError:
        raise ValueError(f"input {name}: a value does not fit {datatype}") from None


def _array(values, dt: np.dtype, via=None) -> np.ndarray:
    """``values`` (a sequence of numbers) as a 1-D array of ``dt`` (through ``via`` first, where
    given), as ``np.asarray`` makes it, a chunk at a time: the GIL can go to other threads between
    chunks, and a chunk's values are all that is made of Python objects at once."""
    out = np.empty(len(values), dt)
    for at in range(0, len(values), _CHUNK):
        out[at:at + _CHUNK] = np.asarray(values[at:at + _CHUNK], via or dt)
    return out


def tensor_from_strings(name: str, items: list[bytes], shape: tuple[int, ...], hold=None) -> np.ndarray:
    """A BYTES input of ``shape`` from its elements (UTF-8 text each); ``hold(nbytes)``: called with
    the bytes of its array before it is made."""
    count = math.prod(shape)
    if len(items) != count:
        raise ValueError(f"input {name}: shape {list(shape)} needs {count} BYTES elements, got {len(items)}")
    return _strings(name, items, hold).reshape(shape)


def tensor_view(a: np.ndarray) -> bytes | memoryview:
    """:func:`tensor_bytes`, without a copy where ``a`` is already little-endian and C-contiguous:
    a view of its memory (which keeps it alive)."""
    if a.dtype.kind in "US":
        return _bytes_elements(a)
    if a.dtype.byteorder not in _LITTLE or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return memoryview(a.reshape(-1).view(np.uint8))


def tensor_bytes(a: np.ndarray) -> bytes:
    """An output's raw bytes: little-endian elements, BYTES as 4-byte lengths and the UTF-8 text."""
    if a.dtype.kind in "US":
        return _bytes_elements(a)
    if a.dtype.byteorder in _LITTLE:
        return a.tobytes()  # (C order)
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


_LITTLE = ("<", "|") + (("=",) if sys.byteorder == "little" else ())


def _flatten(data) -> tuple[list, set]:
    """(the values of nested lists in order, their types): a list that holds no list is its own
    values; a level whose elements are all lists is joined at C speed, and lists of uneven depth are
    walked without recursion (however deep the JSON nests)."""
    if not isinstance(data, list):
        return [data], {type(data)}
    flat = data
    while True:
        kinds = _types(flat)
        if not any(issubclass(k, list) for k in kinds):
            return flat, kinds
        if kinds != {list}:
            flat = _walk(flat)
            return flat, _types(flat)
        joined = []
        for at in range(0, len(flat), _CHUNK):
            joined.extend(itertools.chain.from_iterable(flat[at:at + _CHUNK]))
        flat = joined


def _walk(data: list) -> list:
    """The values of nested lists in order, a Python step each."""
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


def _types(values: list) -> set:
    """The types of ``values``, a chunk at a time: C's loop within a chunk, and between two the GIL
    can go to another thread (the event loop, while the parse thread reads a large request)."""
    kinds = set()
    for at in range(0, len(values), _CHUNK):
        kinds.update(map(type, values[at:at + _CHUNK]))
    return kinds


_CHUNK = 1 << 16  # values (about 0.5 ms of C's loop)


def _strings(name: str, items: list[bytes], hold=None) -> np.ndarray:
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
    if hold is not None:
        hold(len(text) * width * 4)
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
