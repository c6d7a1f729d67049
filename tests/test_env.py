"""The NANOVLLM_* switches: integers, checked with the variable's name."""
import pytest

from nanovllm.utils.env import env_flag, env_int


def test_env_int(monkeypatch):
    monkeypatch.delenv("NANOVLLM_TEST_SWITCH", raising=False)
    assert env_int("NANOVLLM_TEST_SWITCH", 8) == 8
    monkeypatch.setenv("NANOVLLM_TEST_SWITCH", "32")
    assert env_int("NANOVLLM_TEST_SWITCH", 8) == 32
    monkeypatch.setenv("NANOVLLM_TEST_SWITCH", "two")
    with pytest.raises(ValueError, match="NANOVLLM_TEST_SWITCH must be an integer, got 'two'"):
        env_int("NANOVLLM_TEST_SWITCH", 8)
    monkeypatch.setenv("NANOVLLM_TEST_SWITCH", "0")
    with pytest.raises(ValueError, match="NANOVLLM_TEST_SWITCH must be >= 1, got 0"):
        env_int("NANOVLLM_TEST_SWITCH", 8)
    assert env_int("NANOVLLM_TEST_SWITCH", 8, least=0) == 0


def test_env_flag(monkeypatch):
    monkeypatch.delenv("NANOVLLM_TEST_SWITCH", raising=False)
    assert env_flag("NANOVLLM_TEST_SWITCH", True) and not env_flag("NANOVLLM_TEST_SWITCH", False)
    for value, on in (("0", False), ("1", True), ("2", True)):
        monkeypatch.setenv("NANOVLLM_TEST_SWITCH", value)
        assert env_flag("NANOVLLM_TEST_SWITCH", True) is on and env_flag("NANOVLLM_TEST_SWITCH", False) is on
    monkeypatch.setenv("NANOVLLM_TEST_SWITCH", "")  # set but empty: the default
    assert env_flag("NANOVLLM_TEST_SWITCH", True) and not env_flag("NANOVLLM_TEST_SWITCH", False)
    for value in ("false", "-1"):  # refused, not read as on
        monkeypatch.setenv("NANOVLLM_TEST_SWITCH", value)
        with pytest.raises(ValueError, match="NANOVLLM_TEST_SWITCH must be"):
            env_flag("NANOVLLM_TEST_SWITCH", True)


def test_compile_only_where_a_step_runs_compiled():
    """torch.compile is on with CUDA graphs only where a step goes through a compiled
    function: an attention backend that does not fuse the q/k split, or the sampler's paths
    without their kernel. The Triton kernels compile nothing."""
    from nanovllm.utils.compile import compile_needed

    assert not compile_needed(use_graphs=True, fused_attention=True, sampler_kernel=True)
    assert compile_needed(use_graphs=True, fused_attention=False, sampler_kernel=True)
    assert compile_needed(use_graphs=True, fused_attention=True, sampler_kernel=False)
    assert not compile_needed(use_graphs=False, fused_attention=False, sampler_kernel=False)


@pytest.mark.parametrize(("value", "interpreting"), [("1", True), ("true", True), ("Yes", True), ("on", True),
                                                      ("0", False), ("", False), ("off", False), (None, False)])
def test_triton_interpreting_reads_the_variable_as_triton_does(value, interpreting, monkeypatch):
    from nanovllm.utils.env import triton_interpreting

    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreting() is interpreting


def test_every_switch_the_package_reads_is_documented():
    """Each NANOVLLM_* variable named in the package's source appears in README.md or docs/,
    so an A/B switch never exists only in the code."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    named = {m for path in (root / "nanovllm").rglob("*.py")
             for m in re.findall(r'"(NANOVLLM_[A-Z0-9_]+)"', path.read_text())}
    docs = "".join(path.read_text() for path in [root / "README.md", *(root / "docs").glob("*.md")])
    assert len(named) > 20
    assert sorted(name for name in named if name not in docs) == []
