"""meshserve.v1 protocol: meshserve.proto and its generated stubs (regenerate with
`python -m serving.server.proto.generate`; test_server_proto checks they are up to date)."""
