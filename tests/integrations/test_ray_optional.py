"""Ray is an optional extra: nothing but nanovllm/integrations/ray.py imports it, and only when used."""
from __future__ import annotations

import re
import subprocess
import sys

WITHOUT_RAY = "import sys; sys.modules['ray'] = None; "  # `import ray` fails as if it were not installed
MESSAGE = r"nanovllm's Ray integration needs Ray \(ray[.\w]* is missing\): pip install 'nanovllm\[ray\]'"


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_RAY + code], check=False, capture_output=True, text=True,
                          timeout=120)


def test_the_package_and_the_integration_import_without_ray():
    done = run("import nanovllm.integrations.ray, nanovllm.entrypoints.cli, nanovllm.entrypoints.openai.api_server")
    assert done.returncode == 0, done.stderr


def test_using_it_without_ray_is_one_clear_line(tmp_path):
    done = run("from nanovllm.integrations.ray import build_app; build_app('model', device='cpu')")
    assert re.fullmatch("ImportError: " + MESSAGE, done.stderr.strip().splitlines()[-1])
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    done = run(f"from nanovllm.entrypoints.cli import main; main(['run-batch', '--ray', '-i', {str(source)!r}, "
               f"'-o', {str(tmp_path / 'out.jsonl')!r}])")
    assert done.returncode == 1
    assert re.fullmatch("nanovllm: error: " + MESSAGE, done.stderr.strip().splitlines()[-1])
