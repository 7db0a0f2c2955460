"""A PreparedToolCall from its JSON form, and back: the one translation the client, the
CLI and the daemon's approval digest all use."""

from __future__ import annotations

import base64
from typing import Any

from google.protobuf import json_format

from sandboxd_contract.pb import sandboxd_pb2 as pb


def build_call(call: dict[str, Any] | pb.PreparedToolCall) -> pb.PreparedToolCall:
    """A PreparedToolCall from its JSON form (the seed's camelCase names). `stdin` may
    be bytes or base64 text."""
    if isinstance(call, pb.PreparedToolCall):
        return call
    data = dict(call)
    stdin = data.pop("stdin", None)
    message = json_format.ParseDict(data, pb.PreparedToolCall())
    if isinstance(stdin, (bytes, bytearray)):
        message.stdin = bytes(stdin)
    elif isinstance(stdin, str):
        message.stdin = base64.b64decode(stdin)
    return message


def to_json(message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=False, always_print_fields_with_no_presence=True)
