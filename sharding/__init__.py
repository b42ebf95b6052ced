"""Device meshes, logical-axis rules, pipeline/expert parallelism, multi-host start-up and the memory ledger."""
