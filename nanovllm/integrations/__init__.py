"""nanovllm inside other frameworks: ray.py (Ray Serve, Ray Data), the only module that imports Ray."""
