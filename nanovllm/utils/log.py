"""One log format for every process of nanovllm: the server's lines, uvicorn's and the
engine process's read alike, with timestamps."""
from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(level: int) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=DATE_FORMAT)
