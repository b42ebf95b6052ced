"""Benchmarks: `python -m serving.bench offline ...` (serving core) — see serving/bench/offline.py;
`python -m serving.bench serve --target=HOST:PORT ...` (a server over gRPC) — see serving/bench/serve.py."""
import sys

from absl import app


def main(argv):
    commands = {"offline": "serving.bench.offline", "serve": "serving.bench.serve"}
    if len(argv) < 2 or argv[1] not in commands:
        raise app.UsageError(f"usage: python -m serving.bench {{{','.join(commands)}}} [flags]")
    module = __import__(commands[argv[1]], fromlist=["main"])
    module.main()


if __name__ == "__main__":
    # Flags of every benchmark module are defined at import, so absl parses them all.
    import serving.bench.offline  # noqa: F401
    import serving.bench.serve  # noqa: F401
    app.run(main, argv=sys.argv)
