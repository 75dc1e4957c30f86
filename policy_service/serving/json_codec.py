"""Proto3 JSON for the local socket, fast where the message is plain.

``json_format.ParseDict`` and ``MessageToDict`` walk every field in Python and were a third of an
Admit's time on the socket (slurmctld waits for that answer holding its job lock). ``parse`` and
``to_dict`` give the same result for the messages this project sends (strings, bools, integers,
doubles, nested messages, repeated fields, proto3 ``optional``) from a per-message plan built
once, and hand anything else (enums, bytes, real oneofs, maps, well-known types, integers as
strings, nulls, a field named twice, any value of an unexpected type) to ``json_format``, which
then also produces the error message. tests/adapter/serving/test_json_codec.py checks both functions
against ``json_format`` on generated messages and malformed input.
"""
from __future__ import annotations

import math
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from policy_service.trust.limits import _is_repeated as _repeated

_INT_RANGE = {
    FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1), FieldDescriptor.TYPE_SINT64: (-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# proto3 JSON writes 64-bit integers as strings
_INT64_AS_TEXT = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64,
                            FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64})
_STRING, _BOOL, _DOUBLE, _ENUM, _MESSAGE = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BOOL,
                                            FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_ENUM,
                                            FieldDescriptor.TYPE_MESSAGE)


class _Slow(Exception):
    """This input is not plain: json_format takes it."""


def _plain_field(f: FieldDescriptor) -> bool:
    oneof = f.containing_oneof
    if oneof is not None and not (len(oneof.fields) == 1 and oneof.name == f"_{f.name}"):
        return False  # a real oneof (a synthetic one is proto3 `optional`)
    if f.type == _MESSAGE:
        return not f.message_type.GetOptions().map_entry and _plan(f.message_type) is not None
    return f.type in _INT_RANGE or f.type in (_STRING, _BOOL, _DOUBLE, _ENUM)


# A plan entry: (field name, repeated, type, message descriptor or None, field): read from the
# descriptor once, since descriptor attributes cost a call each on every request otherwise.
_Entry = tuple
_PLANS: dict[str, dict[str, _Entry] | None] = {}


def _plan(desc: Descriptor) -> dict[str, _Entry] | None:
    """JSON key (json name and field name) -> entry, or None when the message is not plain."""
    if desc.full_name in _PLANS:
        return _PLANS[desc.full_name]
    _PLANS[desc.full_name] = None  # while it is being planned (a message that contains itself: not plain)
    plan: dict[str, _Entry] | None = {}
    if desc.full_name.startswith("google.protobuf."):
        plan = None  # well-known types have their own JSON forms
    for f in desc.fields if plan is not None else ():
        if not _plain_field(f):
            plan = None
            break
        entry = (f.name, _repeated(f), f.type, f.message_type if f.type == _MESSAGE else None, f)
        plan[f.json_name] = entry
        plan[f.name] = entry
    _PLANS[desc.full_name] = plan
    return plan


def _scalar(f: FieldDescriptor, v: Any) -> Any:
    t, kind = f.type, type(v)
    if t == _STRING:
        if kind is str:
            return v
    elif t == _BOOL:
        if kind is bool:
            return v
    elif t == _DOUBLE:
        if (kind is float and math.isfinite(v)) or kind is int:
            return float(v)
    elif t == _ENUM:
        if kind is str:
            value = f.enum_type.values_by_name.get(v)
            if value is not None:
                return value.number
    elif kind is int:
        lo, hi = _INT_RANGE[t]
        if lo <= v <= hi:
            return v
    raise _Slow


def _build(desc: Descriptor, data: dict) -> Message:
    plan = _plan(desc)
    if plan is None:
        raise _Slow
    kwargs: dict[str, Any] = {}
    for key, v in data.items():
        entry = plan.get(key)
        if entry is None or v is None:
            raise _Slow
        name, repeated, t, sub, f = entry
        if name in kwargs:
            raise _Slow
        if repeated:
            if type(v) is not list:
                raise _Slow
            if sub is not None:
                kwargs[name] = [_build_sub(sub, item) for item in v]
            else:
                kwargs[name] = [_scalar(f, item) for item in v]
        elif sub is not None:
            kwargs[name] = _build_sub(sub, v)
        elif t == _STRING and type(v) is str:  # the common case, inline
            kwargs[name] = v
        else:
            kwargs[name] = _scalar(f, v)
    return desc._concrete_class(**kwargs)


def _build_sub(desc: Descriptor, v: Any) -> Message:
    if type(v) is not dict:
        raise _Slow
    return _build(desc, v)


def parse(data: Any, msg: Message) -> Message:
    """``json_format.ParseDict(data, msg)``, fast when ``data`` is plain."""
    built = _fast(data, msg.DESCRIPTOR)
    if built is None:
        return json_format.ParseDict(data, msg)
    msg.MergeFrom(built)
    return msg


def parsed(data: Any, cls: type[Message]) -> Message:
    """``parse(data, cls())``: the message built from plain ``data`` is the one returned (not
    copied into another)."""
    built = _fast(data, cls.DESCRIPTOR)
    return json_format.ParseDict(data, cls()) if built is None else built


def _fast(data: Any, desc: Descriptor) -> Message | None:
    if type(data) is dict:
        try:
            return _build(desc, data)
        except _Slow:
            pass
    return None


def _value(f: FieldDescriptor, v: Any) -> Any:
    if f.type == _MESSAGE:
        return _dict(v)
    if f.type in _INT64_AS_TEXT:
        return str(v)
    if f.type == _ENUM:
        value = f.enum_type.values_by_number.get(v)
        if value is None:
            raise _Slow  # a number this build does not name
        return value.name
    if f.type == _DOUBLE and not math.isfinite(v):
        raise _Slow
    return v


_OUT: dict = {}  # FieldDescriptor -> (json name, repeated, plain scalar: written as it is)


def _out(f: FieldDescriptor) -> tuple:
    e = _OUT.get(f)
    if e is None:
        plain = f.type in (_STRING, _BOOL) or (f.type in _INT_RANGE and f.type not in _INT64_AS_TEXT)
        e = _OUT[f] = (f.json_name, _repeated(f), plain)
    return e


def _dict(msg: Message) -> dict:
    if _plan(msg.DESCRIPTOR) is None:
        raise _Slow
    out = {}
    for f, v in msg.ListFields():
        key, repeated, plain = _out(f)
        if plain:
            out[key] = list(v) if repeated else v
        else:
            out[key] = [_value(f, x) for x in v] if repeated else _value(f, v)
    return out


def to_dict(msg: Message) -> dict:
    """``json_format.MessageToDict(msg)``, fast when ``msg`` is plain."""
    try:
        return _dict(msg)
    except _Slow:
        return json_format.MessageToDict(msg)
