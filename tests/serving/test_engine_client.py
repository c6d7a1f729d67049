"""Every engine the server's app takes offers all of EngineClient (serving/engine_client.py):
AsyncLLMEngine, ReplicaRouter and the Ray integration's RayEngineClient. None inherits
from the protocol, so a member added to one and not the others shows here, not as an
AttributeError at a request."""
import inspect
import re
from pathlib import Path

import pytest

from nanovllm.integrations.ray import RayEngineClient
from nanovllm.serving.async_engine import AsyncLLMEngine
from nanovllm.serving.engine_client import EngineClient
from nanovllm.serving.router import ReplicaRouter


def protocol_members() -> tuple[set[str], set[str]]:
    """(data attributes, methods and properties) that EngineClient declares."""
    data = set(EngineClient.__annotations__)
    behaviour = {name for name, value in vars(EngineClient).items()
                 if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}
    return data, behaviour


def sets_in_init(cls: type, name: str) -> bool:
    """Whether an __init__ of cls or its bases assigns self.<name> (alone or in a tuple)."""
    pattern = re.compile(rf"self\.{name}\s*(:[^=\n]+)?(,[^=\n]*)?=(?!=)")  # self.x = / self.x: T = / self.x, ... =
    return any(pattern.search(inspect.getsource(klass.__init__)) for klass in cls.__mro__
               if "__init__" in vars(klass) and klass is not object)


def test_the_protocol_declares_what_the_server_uses():
    """Every engine.<member> the entrypoints read is declared (replica_stats is read with
    getattr: only ReplicaRouter has it)."""
    entrypoints = Path(__file__).resolve().parents[2] / "nanovllm" / "entrypoints"
    used = set()
    for path in entrypoints.rglob("*.py"):
        used |= set(re.findall(r"(?:\bself\.|(?<![\w.]))engine\.(\w+)", path.read_text()))
    data, behaviour = protocol_members()
    assert {"generate", "make_request", "config", "latest_stats"} <= used  # the scan finds the server's uses
    assert not used - data - behaviour, f"used but not in EngineClient: {sorted(used - data - behaviour)}"


def test_init_scan_sees_assignments_only():
    class Engine:
        def __init__(self):
            self.config, self.tokenizer = 1, 2
            self.error: str | None = None
            self.checker.limit = 3
            if self.latest_stats == {}:
                pass

    assert sets_in_init(Engine, "config") and sets_in_init(Engine, "tokenizer") and sets_in_init(Engine, "error")
    assert not sets_in_init(Engine, "checker") and not sets_in_init(Engine, "latest_stats")


@pytest.mark.parametrize("cls", [AsyncLLMEngine, ReplicaRouter, RayEngineClient], ids=lambda cls: cls.__name__)
def test_each_engine_offers_every_member(cls):
    data, behaviour = protocol_members()
    missing = sorted(name for name in behaviour if not hasattr(cls, name))
    missing += sorted(name for name in data if not hasattr(cls, name) and not sets_in_init(cls, name))
    assert not missing, f"{cls.__name__} lacks {missing}"
    for name in behaviour & {"generate"}:  # an async generator everywhere: the handlers iterate it
        assert inspect.isasyncgenfunction(getattr(cls, name)), name
