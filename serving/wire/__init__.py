"""meshserve.v1 on the wire, what both sides of a process boundary share: meshserve.proto and its generated stubs
(regenerate with `python -m serving.wire.generate`; tests/serving/wire/test_proto.py checks they are up to date),
the client library (`client`), a GenerateRequest read as the engine's request (`requests`) and the interceptor that
answers undecodable bytes (`decoding`). The gateway reaches instances through this package only."""
