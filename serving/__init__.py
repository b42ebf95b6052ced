"""The serving stack: the engine (`core`), the gRPC instance server (`server`), the gateway (`gateway`), telemetry,
benchmarks (`bench`), the memory ledger, the terminal client and the demo, and what server and gateway share."""
