"""The checked-in gRPC code is exactly what `make protos` makes from protos/ (no Ray)."""

# tests/grpc has no __init__.py on purpose: Ray workers get tests/ on PYTHONPATH, and a
# package named `grpc` there would shadow the real grpc package.

import os

from app.serve.grpc_api.grpc_codegen import GEN_PACKAGE, generate, generated_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel)) as f:
        return f.read()


def test_checked_in_code_matches_the_protos(tmp_path):
    generate(REPO, str(tmp_path))
    for rel in generated_files():
        fresh, checked_in = _read(str(tmp_path), rel), _read(REPO, rel)
        assert fresh == checked_in, f"{rel} differs from protos/: run `make protos` and commit"


def test_no_stale_generated_files():
    on_disk = set()
    for folder, dirs, files in os.walk(os.path.join(REPO, GEN_PACKAGE)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        on_disk |= {os.path.relpath(os.path.join(folder, f), REPO) for f in files}
    assert on_disk == set(generated_files())


def test_generated_modules_import_from_the_app_package():
    from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2, generation_pb2_grpc

    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "slimserve.v1.Generation"
    assert {m.name for m in service.methods} == {
        "Generate",
        "Complete",
        "Tokenize",
        "Detokenize",
        "ListModels",
        "Health",
    }
    assert service.methods_by_name["Generate"].server_streaming
    assert generation_pb2_grpc.GenerationStub


def test_enums_start_unspecified_and_every_message_reserves_the_fork_range():
    from google.protobuf import descriptor_pb2

    from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb

    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    enums = list(proto.enum_type)
    for message in proto.message_type:
        enums += list(message.enum_type)
        ranges = [(r.start, r.end) for r in message.reserved_range]
        assert (500, 1000) in ranges, message.name  # `reserved 500 to 999`
    for enum in enums:
        assert enum.value[0].number == 0 and enum.value[0].name.endswith("_UNSPECIFIED")
    request = next(m for m in proto.message_type if m.name == "GenerateRequest")
    assert "cache_salt" in request.reserved_name  # operator-set, never a request field
