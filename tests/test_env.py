"""The NANOVLLM_* switches: integers, checked with the variable's name."""
import pytest

from nanovllm.utils.env import env_int


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
