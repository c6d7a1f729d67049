"""One log format for every process of nanovllm: the server's lines, uvicorn's and the
engine process's read alike, with timestamps."""
from __future__ import annotations

import logging
import os

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(level: int) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=DATE_FORMAT)


def process_age_s() -> float:
    """Seconds since this process started (interpreter start and imports included), from
    Linux's /proc; 0.0 where that is not available."""
    try:
        with open("/proc/self/stat") as f:  # field 22, after the ")" that ends the name: start time in ticks
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(float(f.read().split()[0]) - started, 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0
