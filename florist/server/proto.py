"""Message classes and RPC plumbing for florist.proto, built at import time.

No `*_pb2.py` is generated into the tree. Generated modules pin the protobuf runtime they were
made for (grpcio-tools 1.8x emits code that refuses an older protobuf), and the GPU image may
have neither the same protobuf nor grpcio-tools. Instead:

    florist.proto ──protoc (grpc_tools, when installed)──┐
                  └─protoparse.parse (fallback)──────────┴─▶ FileDescriptorProto
        ──▶ a private DescriptorPool ──▶ message classes made by the *installed* protobuf runtime

A descriptor is plain data that every protobuf runtime (4.x and later) reads, so the classes
always match the installed runtime. The service side needs no generated code either: handlers
and client callables are built from the service descriptor (`add_servicer`, `method_callables`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from florist.server import protoparse

PROTO_PATH = Path(__file__).with_name("florist.proto")
PROTO_NAME = "florist.proto"


def _compile_with_protoc(proto: Path) -> descriptor_pb2.FileDescriptorProto | None:
    """protoc from grpcio-tools, or None when grpcio-tools is not installed."""
    try:
        from grpc_tools import protoc
    except Exception:  # absent, or built for another Python / protobuf: fall back to the reader
        return None
    with tempfile.TemporaryDirectory(prefix="florist-proto-") as tmp:
        out = os.path.join(tmp, "florist.desc")
        rc = protoc.main(["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}", proto.name])
        if rc != 0:
            raise RuntimeError(f"protoc could not compile {proto} (exit {rc}); its errors are printed above")
        fds = descriptor_pb2.FileDescriptorSet.FromString(Path(out).read_bytes())
    (fdp,) = fds.file
    return fdp


def load_descriptor(proto: Path = PROTO_PATH, *, use_protoc: bool = True) -> descriptor_pb2.FileDescriptorProto:
    fdp = _compile_with_protoc(proto) if use_protoc else None
    if fdp is None:
        fdp = protoparse.parse(proto.read_text(), proto.name)
    return fdp


def _message_class(desc) -> type:
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(desc.file.pool).GetPrototype(desc)  # pragma: no cover


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(load_descriptor().SerializeToString())
FILE = _POOL.FindFileByName(PROTO_NAME)
SERVICE = FILE.services_by_name["Inference"]

TokenBatch = _message_class(FILE.message_types_by_name["TokenBatch"])
Matrix = _message_class(FILE.message_types_by_name["Matrix"])
EmbedRequest = _message_class(FILE.message_types_by_name["EmbedRequest"])
EmbedResponse = _message_class(FILE.message_types_by_name["EmbedResponse"])
ScoreRequest = _message_class(FILE.message_types_by_name["ScoreRequest"])
ScoreResponse = _message_class(FILE.message_types_by_name["ScoreResponse"])
HealthRequest = _message_class(FILE.message_types_by_name["HealthRequest"])
HealthResponse = _message_class(FILE.message_types_by_name["HealthResponse"])
InfoRequest = _message_class(FILE.message_types_by_name["InfoRequest"])
InfoResponse = _message_class(FILE.message_types_by_name["InfoResponse"])
Prompt = _message_class(FILE.message_types_by_name["Prompt"])
GenerateRequest = _message_class(FILE.message_types_by_name["GenerateRequest"])
GenerateChunk = _message_class(FILE.message_types_by_name["GenerateChunk"])


def _classes(method) -> tuple[type, type]:
    return _message_class(method.input_type), _message_class(method.output_type)


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(server: Any, servicer: object) -> None:
    """Register `servicer`'s methods named like the service's RPCs (what a generated
    `add_InferenceServicer_to_server` does). RPCs it lacks answer UNIMPLEMENTED."""
    handlers = {}
    for method in SERVICE.methods:
        fn = getattr(servicer, method.name, None)
        if fn is None:
            continue
        req, resp = _classes(method)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.62: faster method lookup
        server.add_registered_method_handlers(SERVICE.full_name, handlers)


def method_callables(channel: Any) -> dict[str, Callable]:
    """One multi-callable per RPC on `channel` (sync or aio), like a generated stub's attributes."""
    out = {}
    for method in SERVICE.methods:
        req, resp = _classes(method)
        kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                (True, False): channel.stream_unary, (True, True): channel.stream_stream}[(method.client_streaming, method.server_streaming)]
        path = f"/{SERVICE.full_name}/{method.name}"
        try:
            out[method.name] = kind(path, request_serializer=req.SerializeToString, response_deserializer=resp.FromString, _registered_method=True)
        except TypeError:  # grpcio < 1.62 has no registered methods
            out[method.name] = kind(path, request_serializer=req.SerializeToString, response_deserializer=resp.FromString)
    return out
