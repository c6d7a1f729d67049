"""What of a JSON schema xgrammar's grammar would not hold an output to.

xgrammar (0.2.9) compiles a schema it cannot fully express without a word: a keyword it does
not implement is skipped, and so are the assertions beside a $ref or a combinator (anyOf,
oneOf, allOf), which can turn the whole schema into "any JSON". A structured output must
satisfy its schema, so GrammarCompiler refuses a schema that uses any of these, naming the
keyword and where it is (tests/engine/test_structured.py checks each rule against
xgrammar: a value that breaks the schema, which its grammar takes).
"""
from __future__ import annotations

import json
from typing import Any

from nanovllm.utils import is_int

# Keywords xgrammar does not implement.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                       "dependentRequired", "dependentSchemas", "dependencies")
# Keywords that assert something of a value: beside a $ref or a combinator xgrammar drops them
# (others there, annotations and extensions such as "description" or "x-order", assert nothing).
ASSERTIONS = frozenset((
    "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "format", "properties", "required", "additionalProperties",
    "patternProperties", "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "minItems",
    "maxItems", "additionalItems", "unevaluatedItems", "unevaluatedProperties", "anyOf", "oneOf", "allOf", "$ref"))
COMBINATORS = ("anyOf", "oneOf", "allOf")
# Keywords of one type, which xgrammar applies only where "type" names it.
TYPED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
         "pattern", "minItems", "maxItems")
# Where a schema holds subschemas: one, a list of them, a map of names to them.
_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "additionalItems",
        "unevaluatedItems")
_LISTS = (*COMBINATORS, "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None),
               "object": dict, "array": list}


def unenforced(text: str) -> str | None:
    """What of the JSON schema `text` xgrammar would not enforce (the first such keyword, and
    where), or None. Walks the schema, and the targets of its $refs, without recursion: a
    deeply nested one is no error here (xgrammar says what it makes of it)."""
    try:
        root = json.loads(text)
    except (RecursionError, ValueError):
        return None
    stack, seen = [(root, "#")], set()
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if what := _unenforced_here(node):
            return f"{what} (at {path})"
        if isinstance(ref := node.get("$ref"), str):
            stack.append((_resolve(root, ref), ref))
        for key in _ONE:
            stack.append((node.get(key), f"{path}/{key}"))
        for key in _LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in _MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{path}/{key}/{name}") for name, sub in node[key].items())
    return None


def _unenforced_here(node: dict) -> str | None:
    """What of one schema object (not its subschemas) xgrammar would not enforce."""
    if keyword := next((k for k in UNENFORCED_KEYWORDS if k in node), None):
        return repr(keyword)
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema"
    for holder in ("$ref", *COMBINATORS):
        if holder in node and (beside := sorted(node.keys() & ASSERTIONS - {holder})):
            return f"{beside[0]!r} beside {holder!r}"
    if isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#"):
        return f"a '$ref' outside the schema ({node['$ref']!r})"
    types = _types(node)
    if types is None and (keyword := next((k for k in TYPED if k in node), None)):
        return f"{keyword!r} without a 'type'"
    if "multipleOf" in node and not (is_int(node["multipleOf"]) and set(types or ()) <= {"integer", "null"}):
        return "'multipleOf' other than an integer on integers"
    if isinstance(node.get("required"), list):
        named = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if missing := [name for name in node["required"] if name not in named]:
            return f"'required' naming {missing[0]!r}, which 'properties' does not define"
    if "enum" in node and "const" in node and (not isinstance(node["enum"], list) or not any(
            _same(value, node["const"]) for value in node["enum"])):
        return "a 'const' that is not among the 'enum' values"
    if types is not None:
        if "const" in node and not _of_types(node["const"], types):
            return "a 'const' value that is not of the schema's 'type'"
        if isinstance(node.get("enum"), list) and not all(_of_types(value, types) for value in node["enum"]):
            return "'enum' values that are not of the schema's 'type'"
    return None


def _types(node: dict) -> list[str] | None:
    """The JSON types node's "type" names (None: no type, or one that is not JSON's)."""
    names = node.get("type")
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not names or not all(name in _JSON_TYPES for name in names):
        return None
    return names


def _of_types(value: Any, types: list[str]) -> bool:
    """Whether a JSON value (as json.loads gives it) is of one of the JSON-schema types."""
    for name in types:
        if isinstance(value, bool):
            if name == "boolean":
                return True
        elif name == "integer":
            if isinstance(value, int) or isinstance(value, float) and value.is_integer():
                return True
        elif isinstance(value, _JSON_TYPES[name]):
            return True
    return False


def _same(a: Any, b: Any) -> bool:
    """JSON equality at the top: true is not 1, and 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _resolve(root: Any, ref: str) -> Any:
    """The value a local $ref ("#/$defs/Name", a JSON pointer) points at; None if none."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
