"""The committed meshserve.v1 stubs are what protoc generates from meshserve.proto today."""
import os

from serving.wire import generate as gen


def test_generated_stubs_are_up_to_date(tmp_path):
    fresh = gen.generate(str(tmp_path))
    for path in fresh:
        committed = os.path.join(gen.REPO_ROOT, os.path.dirname(gen.PROTO), os.path.basename(path))
        with open(path) as f, open(committed) as g:
            assert gen.stub_content(f.read()) == gen.stub_content(g.read()), (
                f"{committed} is stale: run `python -m serving.wire.generate` and commit the result")


def test_services_and_messages():
    from serving.wire import meshserve_pb2 as pb
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    assert pb.DESCRIPTOR.package == "meshserve.v1"
    assert {m.name for m in service.methods} == {"Generate", "Tokenize", "ModelInfo", "GetLoad", "WatchLoad",
                                                 "Drain", "LoadLoRAAdapter", "UnloadLoRAAdapter", "PullKV",
                                                 "ReleaseKV"}
    assert service.methods_by_name["Generate"].server_streaming
    assert service.methods_by_name["PullKV"].server_streaming  # the KV pages of a transfer, chunk by chunk
    assert service.methods_by_name["WatchLoad"].server_streaming
