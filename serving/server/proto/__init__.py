"""meshserve.v1 protocol: meshserve.proto and its generated stubs (regenerate with
`python -m serving.server.proto.generate`; tests/test_server_proto.py checks they are up to date)."""
