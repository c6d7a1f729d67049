"""The OpenAI-compatible server (`nanovllm serve`); needs the `serve` extra (fastapi, uvicorn, pydantic,
prometheus-client). Importing this package alone needs none of them."""

# Seconds that requests still running at SIGINT / SIGTERM may take to finish before they are aborted.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
