"""A reader for the subset of proto3 that florist.proto uses, producing the FileDescriptorProto
that `protoc --descriptor_set_out` would. It is the fallback for machines without grpcio-tools
(the GPU image ships grpcio and protobuf only); a test checks it against protoc's output.

Supported: `syntax`, `package`, `message` (nested), `enum`, fields with scalar / message / enum
types, `repeated`, `optional` (proto3 presence), `reserved`, `service` with `rpc` and `stream`.
Anything else (imports, options, oneof, map, extensions) is an error that names the line.
"""

from __future__ import annotations

import re

from google.protobuf import descriptor_pb2

F = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    "double": F.TYPE_DOUBLE, "float": F.TYPE_FLOAT, "int64": F.TYPE_INT64, "uint64": F.TYPE_UINT64,
    "int32": F.TYPE_INT32, "fixed64": F.TYPE_FIXED64, "fixed32": F.TYPE_FIXED32, "bool": F.TYPE_BOOL,
    "string": F.TYPE_STRING, "bytes": F.TYPE_BYTES, "uint32": F.TYPE_UINT32, "sfixed32": F.TYPE_SFIXED32,
    "sfixed64": F.TYPE_SFIXED64, "sint32": F.TYPE_SINT32, "sint64": F.TYPE_SINT64,
}
_TOKEN = re.compile(r'\s+|//[^\n]*|/\*.*?\*/|(?P<tok>"[^"\n]*"|[A-Za-z_][\w.]*|-?\d+|[{}()\[\];=<>,])', re.S)


class ProtoSyntaxError(ValueError):
    pass


def _tokens(text: str) -> list[tuple[str, int]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ProtoSyntaxError(f"line {text.count(chr(10), 0, pos) + 1}: unexpected {text[pos]!r}")
        if m.group("tok"):
            out.append((m.group("tok"), text.count("\n", 0, pos) + 1))
        pos = m.end()
    return out


def _json_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


class _Parser:
    def __init__(self, text: str):
        self.toks, self.i = _tokens(text), 0
        self.defined: dict[str, int] = {}  # full name -> TYPE_MESSAGE / TYPE_ENUM
        self.unresolved: list[tuple[F, str, int]] = []  # (field, scope, line)
        self.package = ""
        self.services: list[descriptor_pb2.ServiceDescriptorProto] = []

    def peek(self) -> str:
        return self.toks[self.i][0] if self.i < len(self.toks) else ""

    def fail(self, what: str) -> ProtoSyntaxError:
        line = self.toks[min(self.i, len(self.toks) - 1)][1] if self.toks else 0
        return ProtoSyntaxError(f"line {line}: {what} (florist's proto reader supports a proto3 subset; see protoparse.py)")

    def take(self, expected: str | None = None) -> str:
        if self.i >= len(self.toks):
            raise self.fail("unexpected end of file")
        tok = self.toks[self.i][0]
        if expected is not None and tok != expected:
            raise self.fail(f"expected {expected!r}, found {tok!r}")
        self.i += 1
        return tok

    def file(self, name: str) -> descriptor_pb2.FileDescriptorProto:
        fd = descriptor_pb2.FileDescriptorProto(name=name)
        self.services = fd.service
        while self.peek():
            word = self.take()
            if word == "syntax":
                self.take("=")
                if self.take() != '"proto3"':
                    raise self.fail("only proto3 is supported")
                self.take(";")
                fd.syntax = "proto3"
            elif word == "package":
                self.package = fd.package = self.take()
                self.take(";")
            elif word == "message":
                self.message(fd.message_type.add(), self.package)
            elif word == "enum":
                self.enum(fd.enum_type.add(), self.package)
            elif word == "service":
                self.service(fd.service.add())
            else:
                raise self.fail(f"unsupported top-level statement {word!r}")
        self.resolve()
        return fd

    def _define(self, scope: str, name: str, kind: int) -> str:
        full = f"{scope}.{name}" if scope else name
        self.defined[full] = kind
        return full

    def message(self, msg: descriptor_pb2.DescriptorProto, scope: str) -> None:
        msg.name = self.take()
        full = self._define(scope, msg.name, F.TYPE_MESSAGE)
        self.take("{")
        optional_fields: list[F] = []
        while self.peek() != "}":
            word = self.peek()
            if word == "message":
                self.take()
                self.message(msg.nested_type.add(), full)
            elif word == "enum":
                self.take()
                self.enum(msg.enum_type.add(), full)
            elif word == "reserved":
                while self.take() != ";":
                    pass
            elif word in ("oneof", "map", "option", "extensions", "extend") or word.startswith("map<"):
                raise self.fail(f"{word!r} is not supported")
            else:
                field = self.field(msg, full)
                if field.proto3_optional:
                    optional_fields.append(field)
        self.take("}")
        # proto3 `optional` gets a synthetic oneof "_name", after any real oneofs.
        for field in optional_fields:
            field.oneof_index = len(msg.oneof_decl)
            msg.oneof_decl.add(name="_" + field.name)

    def field(self, msg: descriptor_pb2.DescriptorProto, scope: str) -> F:
        line = self.toks[self.i][1]
        label, optional = F.LABEL_OPTIONAL, False
        if self.peek() in ("repeated", "optional"):
            label = F.LABEL_REPEATED if self.take() == "repeated" else F.LABEL_OPTIONAL
            optional = label == F.LABEL_OPTIONAL
        type_name = self.take()
        field = msg.field.add(name=self.take(), label=label, json_name="")
        self.take("=")
        field.number = int(self.take())
        if self.peek() == "[":
            raise self.fail("field options are not supported")
        self.take(";")
        field.json_name = _json_name(field.name)
        if optional:
            field.proto3_optional = True
        if type_name in SCALARS:
            field.type = SCALARS[type_name]
        else:
            self.unresolved.append((field, scope, line))
            field.type_name = type_name
        return field

    def enum(self, enum: descriptor_pb2.EnumDescriptorProto, scope: str) -> None:
        enum.name = self.take()
        self._define(scope, enum.name, F.TYPE_ENUM)
        self.take("{")
        while self.peek() != "}":
            if self.peek() in ("option", "reserved"):
                raise self.fail(f"{self.peek()!r} in an enum is not supported")
            name = self.take()
            self.take("=")
            enum.value.add(name=name, number=int(self.take()))
            self.take(";")
        self.take("}")

    def service(self, svc: descriptor_pb2.ServiceDescriptorProto) -> None:
        svc.name = self.take()
        self.take("{")
        while self.peek() != "}":
            self.take("rpc")
            method = svc.method.add(name=self.take())
            self.take("(")
            if self.peek() == "stream":
                self.take()
                method.client_streaming = True
            method.input_type = self.take()  # resolved in resolve(), once every type is known
            self.take(")")
            self.take("returns")
            self.take("(")
            if self.peek() == "stream":
                self.take()
                method.server_streaming = True
            method.output_type = self.take()
            self.take(")")
            if self.peek() == "{":
                self.take()
                self.take("}")
            else:
                self.take(";")
        self.take("}")

    def _lookup(self, name: str, scope: str, line: int) -> tuple[str, int]:
        if name.startswith("."):
            candidates = [name[1:]]
        else:
            parts = scope.split(".") if scope else []
            candidates = [".".join(parts[:k] + [name]) for k in range(len(parts), -1, -1)]
        for full in candidates:
            if full in self.defined:
                return "." + full, self.defined[full]
        raise ProtoSyntaxError(f"line {line}: unknown type {name!r}")

    def resolve(self) -> None:
        for field, scope, line in self.unresolved:
            field.type_name, field.type = self._lookup(field.type_name, scope, line)
        for svc in self.services:
            for method in svc.method:
                method.input_type = self._lookup(method.input_type, self.package, 0)[0]
                method.output_type = self._lookup(method.output_type, self.package, 0)[0]


def parse(text: str, name: str) -> descriptor_pb2.FileDescriptorProto:
    return _Parser(text).file(name)
