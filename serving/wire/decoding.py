"""Requests protobuf cannot decode (a string field that is not UTF-8, corrupt wire bytes) answered INVALID_ARGUMENT
naming the field, not gRPC's UNKNOWN: `DecodeErrorInterceptor` gives each unary method a deserializer that keeps the
error (`bad_string_field` finds the field by walking the wire format) and a handler that reports it. The instance
server and the gateway install it."""
from __future__ import annotations

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError


class _Undecodable:
    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("a varint runs past the end")
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7


def is_repeated(field) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 5.29 (`label` is gone from the upb descriptors)
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def bad_string_field(descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path (`chat.messages[1].content`) of the first string field in `data`, a serialized message of
    `descriptor`, whose bytes are not UTF-8; None if there is none. Raises ValueError on malformed wire bytes."""
    seen: dict[int, int] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(data, pos)
            chunk, pos = data[pos:pos + size], pos + size
            if pos > len(data):
                raise ValueError("a field runs past the end")
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = seen.get(number, 0)
            seen[number] = index + 1
            path = prefix + field.name + (f"[{index}]" if is_repeated(field) else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = bad_string_field(field.message_type, chunk, path + ".")
                if found:
                    return found
        else:
            raise ValueError(f"wire type {wire}")
    if pos > len(data):
        raise ValueError("a field runs past the end")
    return None


def tolerant_deserializer(message_cls):
    """message_cls.FromString, except that bytes it cannot decode become an _Undecodable naming why."""
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            try:
                field = bad_string_field(message_cls.DESCRIPTOR, data)
            except ValueError:
                field = None
            if field:
                return _Undecodable(f"{field}: not valid UTF-8 (protobuf strings must be UTF-8; send bytes as "
                                    "token ids)")
            return _Undecodable(f"request: the bytes are not a {message_cls.DESCRIPTOR.full_name} ({e})")
    return parse


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        cls = getattr(getattr(handler, "request_deserializer", None), "__self__", None)
        if handler is None or not isinstance(cls, type):
            return handler
        parse = tolerant_deserializer(cls)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for r in inner_stream(request, context):
                    yield r
            return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=parse,
                                                        response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await inner_unary(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=parse,
                                                       response_serializer=handler.response_serializer)
        return handler
