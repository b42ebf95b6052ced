"""Process logging for servers and the gateway (`setup_logging`: plain text or one JSON object per line, for log
shippers) and `start_entry_point`, the common start of their `main` (usage checks, logging, Prometheus settings)."""
from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    def format(self, record):
        out = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(fmt: str) -> None:
    """Replaces the root handlers with one stderr handler in `fmt` ('text' or 'json'), level INFO."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def start_entry_point(argv, log_format: str, **required) -> None:
    """The start of `main` in `python -m serving.server` and `python -m serving.gateway`: refuses positional
    arguments and empty required flags (`required`: flag name -> value) with absl's UsageError, then sets up
    logging in `log_format` and turns off Prometheus' *_created series (they only add noise to every scrape)."""
    from absl import app
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for name, value in required.items():
        if not value:
            raise app.UsageError(f"--{name} is required")
    setup_logging(log_format)
    import prometheus_client
    prometheus_client.disable_created_metrics()
