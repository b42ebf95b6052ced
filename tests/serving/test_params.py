"""The request contract (serving.params): every SamplingParams field reaches the engine from both APIs (OpenAI HTTP and
meshserve.v1 gRPC, at an instance and through the gateway) by its own name, so a new sampling parameter is three edits
(serving/params.py, meshserve.proto, the OpenAI schema) and nothing else; a copy of the tree with exactly those edits
shows it, the new parameter checked and named in both APIs' errors."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
from google.protobuf.descriptor import FieldDescriptor

from serving import params
from serving.api import protocol
from serving.gateway.validation import check_generate
from serving.params import ModelLimits, SamplingParams, StructuredOutput
from serving.process import REPO_ROOT
from serving.wire import meshserve_pb2 as pb
from serving.wire.client import generate_request
from serving.wire.requests import read_generate

PROTO_FIELDS = pb.SamplingParameters.DESCRIPTOR.fields_by_name
FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}


def _other_value(field: dataclasses.Field):
    """A valid value of the field other than its default, from its annotation."""
    t, default = field.type, field.default
    if t.startswith("bool"):
        return not default
    if t.startswith("int"):
        return 1 if default is None else default + 2
    if t.startswith("float"):
        return 0.5 if default != 0.5 else 0.25
    if t.startswith("tuple[str"):
        return ("xyz",)
    if t.startswith("tuple[int"):
        return (5,)
    if t.startswith("dict[int, float]"):
        return {5: 1.5}
    if t.startswith("str"):
        return "xyz"
    raise AssertionError(f"SamplingParams.{field.name}: this test does not know the type {t}; teach _other_value it")


# Every field but `structured` (which excludes min_tokens and ignore_eos) at a value other than its default.
OTHER = {name: _other_value(f) for name, f in FIELDS.items() if name != "structured"}
JSON_OTHER = {name: list(v) if isinstance(v, tuple) else {str(k): b for k, b in v.items()} if isinstance(v, dict)
              else v for name, v in OTHER.items() if name != "adapter"}  # OpenAI's `model` names the adapter


def test_each_field_is_in_both_schemas_or_mapped_by_hand_with_its_reason():
    for name in FIELDS:
        for by_hand, names in ((params.OPENAI_BY_HAND, protocol.ChatCompletionRequest.model_fields),
                               (params.OPENAI_BY_HAND, protocol.CompletionRequest.model_fields),
                               (params.PROTO_BY_HAND, PROTO_FIELDS)):
            assert name in names or by_hand.get(name), f"SamplingParams.{name} is missing from a schema"
    assert set(params.OPENAI_BY_HAND) | set(params.PROTO_BY_HAND) <= set(FIELDS)
    assert set(PROTO_FIELDS) <= set(FIELDS), "a SamplingParameters field the engine never sees"
    # meshserve.v1's widths, which the OpenAI API enforces so the gateway can forward what it accepts
    assert {n for n, f in PROTO_FIELDS.items() if f.type == FieldDescriptor.TYPE_INT32} == set(params.INT32_FIELDS)
    assert params.PRIORITIES == (pb.PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH)


def test_the_mappings_carry_every_field():
    """Every field, each at a value other than its default, through each way a request reaches an engine."""
    expected = SamplingParams(**OTHER)
    # meshserve.v1 at an instance (what InferenceServicer hands the engine)
    assert read_generate(generate_request([1, 2, 3], **OTHER), 1 << 20).params == expected
    chat = {k: v for k, v in JSON_OTHER.items() if k not in ("max_tokens", "logprobs")}
    bodies = [
        (protocol.CompletionRequest, dict(JSON_OTHER, prompt=[1, 2, 3])),
        (protocol.ChatCompletionRequest, dict(chat, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                              top_logprobs=OTHER["logprobs"],
                                              max_completion_tokens=OTHER["max_tokens"])),
    ]
    for cls, body in bodies:
        req = cls.model_validate_json(json.dumps(body))
        if cls is protocol.CompletionRequest:
            ereq = protocol.completion_request(req, None, render_elsewhere=True)
        else:
            ereq = protocol.chat_request(req, None, render_elsewhere=True)
        ereq.sampling["adapter"] = OTHER["adapter"]  # as OpenAIApp does when `model` names an adapter
        assert ereq.sampling_params() == expected  # OpenAI at an instance (what OpenAIServer hands the engine)
        forwarded = generate_request([1, 2, 3], **ereq.sampling)  # OpenAI at the gateway, sent on as meshserve.v1
        assert check_generate(forwarded, ModelLimits())[0] == expected
        assert read_generate(forwarded, 1 << 20).params == expected  # and read by the instance behind it
    structured = SamplingParams(structured=StructuredOutput(regex="a+"))
    assert read_generate(generate_request([1], structured={"regex": "a+"}), 1 << 20).params == structured
    req = protocol.CompletionRequest.model_validate_json(json.dumps({"prompt": [1], "max_tokens": 16,
                                                                     "structured_outputs": {"regex": "a+"}}))
    assert protocol.completion_request(req, None).sampling_params() == structured


# The three edits of a new parameter, each an anchor in the file and the text put before (-) or after (+) it.
NEW_PARAMETER = {
    "serving/params.py": [
        ("    structured: StructuredOutput | None = None", "-", "    new_knob: float = 0.0  # a new parameter\n"),
        ("    if p.structured is not None:\n", "-", '    check_float("new_knob", p.new_knob, lo=0.0, hi=1.0)\n'),
    ],
    "serving/wire/meshserve.proto": [
        ("  StructuredOutput structured = 20;\n", "+", "  optional double new_knob = {number};\n"),
    ],
    "serving/api/protocol.py": [
        ("    spaces_between_special_tokens: bool | None = None\n", "+", "    new_knob: float | None = None\n"),
    ],
}
SCRIPT = """
import json
from serving.api import protocol
from serving.gateway.validation import check_generate
from serving.params import ModelLimits
from serving.wire.client import generate_request
from serving.wire.requests import read_generate, status_details

out = {"grpc": read_generate(generate_request([1, 2, 3], new_knob=0.25), 1 << 20).params.new_knob}
body = protocol.CompletionRequest.model_validate_json(json.dumps({"prompt": [1, 2, 3], "new_knob": 0.5}))
ereq = protocol.completion_request(body, None)
out["openai"] = ereq.sampling_params().new_knob
forwarded = generate_request([1, 2, 3], priority=ereq.priority, **ereq.sampling)
out["gateway"] = check_generate(forwarded, ModelLimits())[0].new_knob
out["behind_gateway"] = read_generate(forwarded, 1 << 20).params.new_knob
try:
    read_generate(generate_request([1], new_knob=2.0), 1 << 20)
except ValueError as e:
    out["grpc_error"] = status_details(e)
bad = protocol.completion_request(protocol.CompletionRequest.model_validate_json('{"prompt": [1], "new_knob": 2.0}'),
                                  None)
try:
    bad.sampling_params()
except ValueError as e:
    out["http_error"] = protocol.api_error(e, bad.renames).body()["error"]
print(json.dumps(out))
"""


@pytest.mark.e2e
def test_a_new_parameter_is_three_edits(tmp_path):
    """A copy of `serving/` with a new parameter added to serving/params.py (with its check), meshserve.proto (the
    stubs regenerated) and the OpenAI schema, and no other edit: both APIs carry it to the engine's SamplingParams, at
    an instance and through the gateway, and refuse a bad value naming it."""
    shutil.copytree(os.path.join(REPO_ROOT, "serving"), tmp_path / "serving",
                    ignore=shutil.ignore_patterns("__pycache__"))
    number = max(f.number for f in PROTO_FIELDS.values()) + 1
    for path, edits in NEW_PARAMETER.items():
        text = (tmp_path / path).read_text()
        for anchor, where, added in edits:
            assert text.count(anchor) == 1, f"{path}: the anchor {anchor!r} moved; update NEW_PARAMETER"
            added = added.format(number=number)
            text = text.replace(anchor, added + anchor if where == "-" else anchor + added)
        (tmp_path / path).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO_ROOT]))
    subprocess.run([sys.executable, "-m", "serving.wire.generate"], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=120)
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert (out["grpc"], out["openai"], out["gateway"], out["behind_gateway"]) == (0.25, 0.5, 0.5, 0.5)
    assert out["grpc_error"] == "sampling.new_knob must be in [0.0, 1.0], got 2.0"
    assert out["http_error"]["message"] == "new_knob must be in [0.0, 1.0], got 2.0"
    assert out["http_error"]["param"] == "new_knob"
