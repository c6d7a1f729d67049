"""The package's shape: each folder one concept, imports flowing down only, no circles,
files short enough to read, and the test helpers kept out of what users run."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanovllm"
MAX_LINES = 450

# Lowest first. A module may import from its own layer and the layers below it; within a
# layer the module graph must have no circles. testing/ sits outside: it may import
# anything, and nothing of the package imports it.
LAYERS = [
    ["nanovllm.utils"],
    ["nanovllm.config", "nanovllm.outputs", "nanovllm.sampling_params", "nanovllm.sequence", "nanovllm.inputs",
     "nanovllm.speculative_config",
     "nanovllm.demo", "nanovllm.beam_search"],
    ["nanovllm.kernels"],
    ["nanovllm.layers", "nanovllm.sampling"],
    ["nanovllm.models"],
    ["nanovllm.executor"],
    ["nanovllm.engine"],
    ["nanovllm.llm", "nanovllm.offline", "nanovllm.serving"],
    ["nanovllm.entrypoints", "nanovllm.integrations", "nanovllm", "nanovllm.__main__"],
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The nanovllm modules a file imports: at the top, inside functions, or for type
    checkers alone (a layer's types are part of its shape too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name == "nanovllm" or name.startswith("nanovllm.")}


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {target for target in imports(path) if target in MODULES}
         for name, path in MODULES.items()}


def layer_of(module: str) -> int | None:
    """The index of the most specific layer prefix that holds the module."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


@pytest.mark.parametrize("module", [m for m in MODULES if not m.startswith("nanovllm.testing")])
def test_every_import_flows_down(module):
    assert layer_of(module) is not None, f"{module} is in no layer: add it to LAYERS"
    upward = [target for target in GRAPH[module] if (layer_of(target) or 0) > layer_of(module)]
    assert not upward, f"{module} imports from higher layers: {upward}"
    assert not [t for t in GRAPH[module] if t.startswith("nanovllm.testing")], f"{module} imports nanovllm.testing"


def test_no_import_circles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in MODULES:
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_files_stay_short(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
