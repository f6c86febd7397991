"""The codec: a message as frames and back. Frame 0 is a msgpack header (the protocol
version, the op and the message's fields); an array travels in a frame of its own,
zero-copy, named in the header by dtype and length. `decode` validates every frame from
the network (version, op, field types, frame count, byte length, then the message's own
checks; a record inside a message, such as a plan, alike, field by field) and raises
ProtocolError, never anything else, for a message it refuses."""

import dataclasses
import functools
import itertools
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
    never a bool; a tuple[...] is a msgpack array of such items, a record (a dataclass
    inside a message: a BatchPlan, a JobSpec) a map. Built once per type, as every
    message's every field is tested."""
    if isinstance(tp, types.UnionType):
        tests = tuple(_check(arg) for arg in tp.__args__)
        return lambda value: any(test(value) for test in tests)
    if isinstance(tp, types.GenericAlias) and tp.__origin__ is tuple:
        if tp.__args__[-1] is Ellipsis:
            item = _check(tp.__args__[0])
            return lambda value: isinstance(value, list) and all(map(item, value))
        items = tuple(_check(arg) for arg in tp.__args__)
        return lambda value: isinstance(value, list) and len(value) == len(items) and all(
            test(v) for test, v in zip(items, value))
    if _record(tp):
        return lambda value: isinstance(value, dict)
    if tp is type(None):
        return lambda value: value is None
    if tp is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    return lambda value: isinstance(value, tp)


def _record(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def _convert(tp):
    """None where a header value that passed _check(tp) is the field's value as it is; else
    a function (value, where) -> the typed value (a tuple, a record built and checked),
    raising ProtocolError."""
    if isinstance(tp, types.UnionType):
        parts = tuple((_check(arg), _convert(arg)) for arg in tp.__args__)
        if all(convert is None for _, convert in parts):
            return None
        return lambda value, where: next(value if convert is None else convert(value, where)
                                         for test, convert in parts if test(value))
    if isinstance(tp, types.GenericAlias) and tp.__origin__ is tuple:
        variadic = tp.__args__[-1] is Ellipsis
        converts = tuple(_convert(arg) for arg in tp.__args__[:1 if variadic else None])
        if all(convert is None for convert in converts):
            return lambda value, where: tuple(value)
        return lambda value, where: tuple(
            v if convert is None else convert(v, f"{where}[{i}]")
            for i, (convert, v) in enumerate(zip(itertools.repeat(converts[0]) if variadic else converts, value)))
    if _record(tp):
        return lambda value, where: _build(tp, value, where)
    return None


@functools.cache
def _header_fields(cls) -> tuple:
    """(name, type, its test, its conversion, required) of each field of `cls`, in order;
    the test None for the data, which comes in its own frame."""
    return tuple((f.name, f.type, None if f.name == "data" else _check(f.type), _convert(f.type),
                  f.default is MISSING and f.default_factory is MISSING)
                 for f in fields(cls))


def _build(cls, header: dict, where: str, data=None):
    """An instance of `cls` (a message or a record inside one) from its header map, each
    field checked against its type, then the instance's own check(); ProtocolError names
    the field by its path from the op (`where`), e.g. welcome.cluster.ranges."""
    kwargs = {}
    for name, tp, ok, convert, required in _header_fields(cls):
        if ok is None:
            kwargs["data"] = data
            continue
        if name not in header:
            if not required:  # optional field, left to its default
                continue
            raise ProtocolError("bad_field", f"{where} lacks field {name!r}")
        value = header[name]
        if not ok(value):
            raise ProtocolError("bad_field", f"{where}.{name} has type {type(value).__name__}, expected {tp}")
        kwargs[name] = value if convert is None else convert(value, f"{where}.{name}")
    try:
        out = cls(**kwargs)
        out.check()
    except ValueError as exc:
        raise ProtocolError("bad_field", f"{where}: {exc}") from None
    return out


def encode(msg: Message) -> list:
    """Frames for `msg`: the packed header, then the data as a zero-copy view."""
    header = {"v": VERSION, "op": msg.OP}
    data = None
    for name, _, _, convert, _ in _header_fields(type(msg)):
        value = getattr(msg, name)
        if name == "data":
            data = value
        elif convert is not None and dataclasses.is_dataclass(value):
            header[name] = dataclasses.asdict(value)
        else:
            header[name] = value
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
    try:
        return _build(cls, header, cls.OP, _decode_data(header, _frame_bytes(frames[1])) if cls.HAS_DATA else None)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.text, cls.OP) from None


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
