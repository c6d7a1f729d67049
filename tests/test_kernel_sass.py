"""benchmarks/kernel_sass.py: decode attention compiled for sm_90 on a machine without a
GPU (Triton's compiler and the cuobjdump its wheel ships), and its loop finder."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"


def test_the_loop_is_the_backward_branchs_body():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from kernel_sass import loop_bodies, shared_accesses
    finally:
        sys.path.remove(str(SCRIPT.parent))
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   EXIT ;
        /*0050*/                   BRA 0x50 ;
        /*0060*/                   BRA 0x20 ;
    """
    # neither the self-branch at 0x50 nor the unconditional jump back at 0x60 is a loop
    assert loop_bodies(sass) == [["HMMA.16816.F32", "LDSM.16.M88.4", "BRA"]]
    # 32 lanes x 16, 8, 4 and 1 bytes; an ldmatrix of four 8 x 8 16-bit matrices, stmatrix of two and of one:
    # a wavefront per 128 bytes, at least one each
    assert shared_accesses(["LDS.128", "STS.64", "LDS", "LDS.U8", "LDSM.16.MT88.4", "STSM.16.M88.2", "STSM.16.M88",
                            "HMMA.16816.F32"]) == (32 * (16 + 8 + 4 + 1) + 512 + 256 + 128, 4 + 2 + 1 + 1 + 4 + 2 + 1)


def test_compiles_decode_attention_for_sm90_without_a_gpu():
    import triton.backends.nvidia as nvidia

    if not (Path(nvidia.__file__).parent / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton wheel ships no cuobjdump")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(SCRIPT.parents[1])}
    out = subprocess.run([sys.executable, str(SCRIPT), "--batch", "256"], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout
    assert "registers per thread" in out and "programs" in out
    assert "instructions per warp per 64-token tile" in out and "HMMA" in out and "wavefronts per token" in out
