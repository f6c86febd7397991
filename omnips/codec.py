"""The codec: a message as frames and back. Frame 0 is a msgpack header (the protocol
version, the op and the message's fields); an array travels in a frame of its own,
zero-copy, named in the header by dtype and length. `decode` validates every frame from
the network (version, op, field types, frame count, byte length, then the message's own
checks) and raises ProtocolError, never anything else, for a message it refuses."""

import functools
import types
from dataclasses import MISSING, fields

import msgpack
import numpy as np

from .fieldchecks import brief
from .protocol import DTYPES, MAX_HEADER_BYTES, OPS, VERSION, Message, ProtocolError


def type_ok(value, tp) -> bool:
    return _check(tp)(value)


@functools.cache
def _check(tp):
    """A test of a header value against the field type `tp`: a number is an int or a float,
    never a bool. Built once per type, as every message's every field is tested."""
    if isinstance(tp, types.UnionType):
        tests = tuple(_check(arg) for arg in tp.__args__)
        return lambda value: any(test(value) for test in tests)
    if tp is type(None):
        return lambda value: value is None
    if tp is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    return lambda value: isinstance(value, tp)


@functools.cache
def _header_fields(cls) -> tuple:
    """(name, type, its test, required) of each field of `cls`, in order; the test None for
    the data, which comes in its own frame."""
    return tuple((f.name, f.type, None if f.name == "data" else _check(f.type),
                  f.default is MISSING and f.default_factory is MISSING)
                 for f in fields(cls))


def encode(msg: Message) -> list:
    """Frames for `msg`: the packed header, then the data as a zero-copy view."""
    header = {"v": VERSION, "op": msg.OP}
    data = None
    for f in fields(msg):
        value = getattr(msg, f.name)
        if f.name == "data":
            data = value
        else:
            header[f.name] = value
    if data is None:
        return [msgpack.packb(header)]
    tag = next((t for t, dt in DTYPES.items() if data.dtype == dt), None)
    if tag is None or data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError("wire data must be a 1-D C-contiguous array of little-endian float32, "
                         "float16 or uint16 (bfloat16 bits)")
    header["dt"] = tag
    header["len"] = int(data.size)
    return [msgpack.packb(header), memoryview(data)]


def _frame_bytes(frame) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode(frames: list) -> Message:
    """Validate `frames` (zmq Frames or bytes) and return the typed message."""
    if not frames:
        raise ProtocolError("empty", "a message needs at least a header frame")
    raw = _frame_bytes(frames[0])
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError("bad_header", f"header of {raw.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("bad_header", f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("bad_header", f"header must be a map, not {type(header).__name__}")
    if not type_ok(header.get("v"), int) or header["v"] != VERSION:
        raise ProtocolError("version", f"protocol version {brief(header.get('v'))}, this process speaks {VERSION}")
    op = header.get("op")
    cls = OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError("bad_op", f"unknown op {brief(op)}")
    want = 2 if cls.HAS_DATA else 1
    if len(frames) != want:
        raise ProtocolError("bad_frames", f"{cls.OP} takes {want} frame(s), got {len(frames)}")
    kwargs = {}
    for name, tp, ok, required in _header_fields(cls):
        if ok is None:
            kwargs["data"] = _decode_data(header, _frame_bytes(frames[1]))
            continue
        if name not in header:
            if not required:  # optional field, left to its default
                continue
            raise ProtocolError("bad_field", f"{cls.OP} lacks field {name!r}")
        value = header[name]
        if not ok(value):
            raise ProtocolError("bad_field", f"{cls.OP}.{name} has type {type(value).__name__}, expected {tp}")
        kwargs[name] = value
    msg = cls(**kwargs)
    try:
        msg.check()
    except ValueError as exc:
        raise ProtocolError("bad_field", f"{cls.OP}: {exc}") from None
    return msg


def _decode_data(header: dict, buf: memoryview) -> np.ndarray:
    tag = header.get("dt")
    dtype = DTYPES.get(tag) if isinstance(tag, str) else None
    if dtype is None:
        raise ProtocolError("bad_dtype", f"data dtype {brief(tag)}, expected one of {', '.join(DTYPES)}")
    n = header.get("len")
    if not type_ok(n, int) or n < 0:
        raise ProtocolError("bad_field", f"data length {brief(n)} is not a count")
    if buf.nbytes != n * dtype.itemsize:
        raise ProtocolError("bad_length", f"data frame has {buf.nbytes} bytes, header says {n} {tag} "
                                          f"({dtype.itemsize} bytes each)")
    return np.frombuffer(buf, dtype=dtype)
