"""The bytes p2ptrain peers exchange stay the same while the code moves: each message kind of proto/, filled in
every field, must encode to the golden copy made before the core was reorganised (issue 16). A deliberate change of
the wire format is a new protocol version: regenerate with `P2PTRAIN_WRITE_GOLDEN=1 pytest tests/unit/test_wire_golden.py`
and say so in the commit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from p2ptrain.proto import p2ptrain_pb2

GOLDEN = Path(__file__).parent / "golden" / "wire_messages.json"
MESSAGES = sorted(p2ptrain_pb2.DESCRIPTOR.message_types_by_name)


def repeated(field) -> bool:
    return field.is_repeated if hasattr(field, "is_repeated") else repeated(field)


def filled(message_class):
    """A message with every field set to a value made from its number: the same message every time."""
    message = message_class()
    for field in message.DESCRIPTOR.fields:
        n = field.number
        value = {
            FieldDescriptor.TYPE_STRING: f"field-{n}",
            FieldDescriptor.TYPE_BYTES: bytes(range(n, n + 4)),
            FieldDescriptor.TYPE_BOOL: True,
            FieldDescriptor.TYPE_DOUBLE: n + 0.25,
            FieldDescriptor.TYPE_FLOAT: n + 0.5,
        }.get(field.type, n * 1000 + 7)  # integer kinds
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            target = getattr(message, field.name)
            sub = filled(type(target) if not repeated(field) else target.add().__class__)
            if repeated(field):
                del target[:]
                target.add().CopyFrom(sub)
                target.add().CopyFrom(sub)
            else:
                target.CopyFrom(sub)
        elif field.type == FieldDescriptor.TYPE_ENUM:
            values = field.enum_type.values
            value = values[-1].number
            if repeated(field):
                getattr(message, field.name).extend([value, values[0].number])
            else:
                setattr(message, field.name, value)
        elif repeated(field):
            getattr(message, field.name).extend([value, value])
        else:
            setattr(message, field.name, value)
    return message


def encodings() -> dict:
    return {name: filled(getattr(p2ptrain_pb2, name)).SerializeToString(deterministic=True).hex() for name in MESSAGES}


def test_every_message_kind_encodes_to_its_golden_bytes():
    if os.environ.get("P2PTRAIN_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(encodings(), indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == MESSAGES, "a message kind was added or removed: a new protocol version"
    now = encodings()
    changed = [name for name in MESSAGES if now[name] != golden[name]]
    assert not changed, f"the encoding of {changed} changed: the wire format is not the one peers speak"


def test_the_golden_bytes_decode_to_the_filled_messages():
    """The other direction: a peer running this code reads what the golden peers wrote, field for field."""
    golden = json.loads(GOLDEN.read_text())
    for name in MESSAGES:
        message_class = getattr(p2ptrain_pb2, name)
        assert message_class.FromString(bytes.fromhex(golden[name])) == filled(message_class), name
