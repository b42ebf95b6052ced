"""Device meshes and logical-axis rules, pipeline stages, expert placement and multi-host start-up."""
