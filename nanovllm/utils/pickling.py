"""What the server's two processes do so that each step's messages cost little: fast
pickling for the small dataclasses they exchange, and a garbage collector that leaves
their start-up objects alone."""
from __future__ import annotations

import gc
from dataclasses import fields
from operator import attrgetter
from typing import TypeVar

T = TypeVar("T", bound=type)


def pickle_as_arguments(cls: T) -> T:
    """Class decorator (above @dataclass): pickle instances as their constructor's
    positional arguments. A slotted dataclass otherwise pickles a state that Python-level
    code reads back, several times slower for a step's streamed deltas (benchmarks/
    RESULTS.md, the CPU serving profile). Every field must be an __init__ argument."""
    names = [f.name for f in fields(cls)]
    if len(names) < 2 or any(not f.init for f in fields(cls)):
        raise TypeError(f"{cls.__name__}: pickle_as_arguments needs two or more fields, all set by __init__")
    values = attrgetter(*names)

    def __reduce__(self):
        return cls, values(self)

    cls.__reduce__ = __reduce__
    return cls


def freeze_startup_objects() -> None:
    """Collect, then move every object alive now out of the garbage collector's view.

    After importing torch and building a model a process holds hundreds of thousands of
    tracked objects, and a full collection walks them all. Serving keeps creating
    containers that outlive a step (each step's outputs), which sets off full collections:
    a pause of that length every few dozen steps. Frozen objects are never collected, so
    this is for processes that keep their start-up objects until they exit (the server's
    API and engine processes), not for code that builds and drops engines."""
    gc.collect()
    gc.freeze()
