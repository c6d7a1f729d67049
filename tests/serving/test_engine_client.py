"""Every engine the server's app takes offers all of EngineClient (serving/engine_client.py):
AsyncLLMEngine, ReplicaRouter and the Ray integration's RayEngineClient. None inherits
from the protocol, so a member added to one and not the others shows here, not as an
AttributeError at a request."""
import inspect
import re

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
    pattern = re.compile(rf"self\.{name}\b[^=\n]*=")
    return any(pattern.search(inspect.getsource(klass.__init__)) for klass in cls.__mro__
               if "__init__" in vars(klass) and klass is not object)


def test_the_protocol_declares_what_the_server_calls():
    data, behaviour = protocol_members()
    assert {"config", "tokenizer", "checker", "error", "latest_stats", "on_finished"} <= data
    assert {"generate", "make_request", "start", "shutdown", "abort_all", "is_running", "is_healthy"} <= behaviour


@pytest.mark.parametrize("cls", [AsyncLLMEngine, ReplicaRouter, RayEngineClient], ids=lambda cls: cls.__name__)
def test_each_engine_offers_every_member(cls):
    data, behaviour = protocol_members()
    missing = sorted(name for name in behaviour if not hasattr(cls, name))
    missing += sorted(name for name in data if not hasattr(cls, name) and not sets_in_init(cls, name))
    assert not missing, f"{cls.__name__} lacks {missing}"
    for name in behaviour & {"generate"}:  # an async generator everywhere: the handlers iterate it
        assert inspect.isasyncgenfunction(getattr(cls, name)), name
