"""florist.proto: the built-in reader agrees with protoc, classes work without grpcio-tools, and
the contract keeps ragged data flat (no repeated numeric field per token or per value)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from florist.server import proto, protoparse, wire


def test_builtin_reader_matches_protoc():
    pytest.importorskip("grpc_tools")
    assert proto.load_descriptor(use_protoc=False) == proto.load_descriptor(use_protoc=True)


def test_message_classes_work_without_grpc_tools():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["grpc_tools"] = None  # as on an image with grpcio but no grpcio-tools
        from florist.server import proto
        r = proto.EmbedRequest(tokens=proto.TokenBatch(ids=b"\\x01\\x00\\x00\\x00", seq_lens=b"\\x01\\x00\\x00\\x00"), encoding="float")
        r.normalize = False
        back = proto.EmbedRequest.FromString(r.SerializeToString())
        assert back == r and back.HasField("normalize")
        assert {"Embed", "Score", "Health", "Info"} <= {m.name for m in proto.SERVICE.methods}
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reader_refuses_what_it_does_not_support():
    with pytest.raises(protoparse.ProtoSyntaxError, match="line 3: 'map' is not supported"):
        protoparse.parse('syntax = "proto3";\nmessage A {\n  map<string, int32> m = 1;\n}\n', "x.proto")
    with pytest.raises(protoparse.ProtoSyntaxError, match="unknown type 'Nope'"):
        protoparse.parse('syntax = "proto3";\nmessage A {\n  Nope n = 1;\n}\n', "x.proto")


def test_no_repeated_numbers_on_the_hot_path():
    numeric = {f for f in descriptor_pb2.FieldDescriptorProto.Type.values()} - {
        descriptor_pb2.FieldDescriptorProto.TYPE_STRING, descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
        descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
    }
    repeated_numbers = [
        f"{m.name}.{f.name}" for m in proto.load_descriptor().message_type for f in m.field
        if f.label == f.LABEL_REPEATED and f.type in numeric
    ]
    assert repeated_numbers == ["Matrix.shape"]  # one entry per axis


def test_wire_round_trips():
    seqs = [[1, 2, 3], [4], [5, 6]]
    tb = wire.encode_tokens(seqs, proto.TokenBatch)
    ids, lens = wire.decode_tokens(proto.TokenBatch.FromString(tb.SerializeToString()), vocab_size=10, max_seq_len=3)
    assert ids.tolist() == [1, 2, 3, 4, 5, 6] and lens.tolist() == [3, 1, 2] and ids.flags.writeable
    packed = wire.encode_tokens((np.asarray([1, 2, 3], "<i4").tobytes(), [2, 1]), proto.TokenBatch)
    assert wire.decode_tokens(packed, vocab_size=10, max_seq_len=3)[1].tolist() == [2, 1]
    for x in (np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(6, dtype=np.int8).reshape(2, 3), np.arange(4, dtype=np.float32)):
        m = proto.Matrix.FromString(wire.encode_matrix(x, proto.Matrix).SerializeToString())
        np.testing.assert_array_equal(wire.decode_matrix(m), x)
