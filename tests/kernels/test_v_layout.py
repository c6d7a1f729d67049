"""benchmarks/bench_v_layout.py, the experiment on issue 20's lever: both V layouts
give torch's attention (interpreter), and compiled for sm_90 only the transposed one
moves V without one-byte loads."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_v_layout.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_v_layout", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_layouts_match_torch() -> None:
    assert load_script().check("cpu", contexts=(1, 63, 300)) < 2e-2


def test_transposed_v_needs_no_byte_loads() -> None:
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    # Compiled in a child without TRITON_INTERPRET, which the CPU tests set.
    code = (f"import importlib.util as u; s = u.spec_from_file_location('b', {str(SCRIPT)!r}); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); "
            "print(*(sum(n for op, n in m.ptx_counts(f, 128, 2, 1).items() if op.endswith('.b8')) for f in (False, True)))")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    as_stored, transposed = map(int, result.stdout.split()[-2:])
    assert as_stored > 0 and transposed == 0
