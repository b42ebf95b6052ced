"""Every benchmark of the project, a module each behind `python -m serving.bench NAME` (see __main__.py);
harness.py holds what they share, llamacpp.py the llama.cpp side of `offline`. Details: docs/benchmarks.md."""
