"""What of a JSON schema xgrammar's grammar would not hold an output to, or would take too
long to build.

xgrammar (0.2.9) compiles a schema it cannot fully express without a word: a keyword it does
not implement is skipped, and so are the assertions beside a $ref or a combinator (anyOf,
oneOf, allOf), which can turn the whole schema into "any JSON". A structured output must
satisfy its schema, so GrammarCompiler refuses a schema that uses any of these, naming the
keyword and where it is (tests/engine/test_structured.py checks each rule against
xgrammar: a value that breaks the schema, which its grammar takes).

A schema's "pattern" becomes grammar rules with every bounded repetition written out, and a
repetition of a part whose own length varies (`([a-z]{1,10}){1,10}`) takes time that grows
far faster than its size: seconds at that one, minutes past it, on a thread no client's
departure stops. pattern_cost estimates that size; patterns past MAX_PATTERN_COST are refused.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

try:
    import re._constants as sre
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as sre
    import sre_parse

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
# The largest pattern_cost let through. On one thread of a 2-core CI machine (xgrammar 0.2.9):
# [a-z]{1,1000} (cost 1,000) 0.2 s, [a-z]{1,3000} 0.6 s, [a-z]{1,5000} 5.6 s; ([a-z]{1,3}){1,10}
# (300) 0.27 s, ([a-z]{1,10}){1,10} (1,000) 2.2 s, ([a-z]{1,10}){1,17} (2,890) 1.3 s,
# ([a-z]{1,20}){1,20} (8,000) 7.8 s, ([a-z]{1,100}){1,100} (10**6) past five minutes;
# (\w+\s?){1,50} (100: its part runs on) 0.7 s.
MAX_PATTERN_COST = 3000
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None),
               "object": dict, "array": list}


def refusal(text: str) -> str | None:
    """Why the JSON schema `text` is refused (the first keyword xgrammar would not enforce, or
    the first pattern too costly to build, and where: the end of a sentence that starts with
    the schema's name), or None. Walks the schema, and the targets of its $refs, without recursion: a
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
            return f"uses {what} (at {path}), which structured outputs cannot enforce"
        if what := _costly_pattern(node) or _past_int64(node):
            return f"has {what} (at {path})"
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


def _costly_pattern(node: dict) -> str | None:
    """A 'pattern' of node (or of its patternProperties' names) past MAX_PATTERN_COST."""
    patterns = [node.get("pattern")]
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        if isinstance(pattern, str) and (cost := pattern_cost(pattern)) > MAX_PATTERN_COST:
            return (f"a 'pattern' whose repetitions write out to a grammar too large to build ({pattern[:40]!r}: "
                    f"~{cost:,} against at most {MAX_PATTERN_COST:,}; a repetition of a part of varying length "
                    f"costs the square of its count)")
    return None


def _past_int64(node: dict) -> str | None:
    """A bound of an integer schema past 64 bits, which xgrammar cannot compile (its message
    is an internal check's)."""
    if "integer" not in (_types(node) or ()):
        return None
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            shown = str(value) if len(str(value)) <= 24 else str(value)[:20] + "..."
            return f"an integer {key!r} ({shown}) past what 64 bits hold, which structured outputs cannot compile"
    return None


# ECMA-262 forms Python's parser does not read, as forms it does that cost the same:
# named groups (?<name>...) (not the lookbehinds (?<= and (?<!), and \p{...} / \P{...} classes.
_ECMA_FORMS = ((re.compile(r"\(\?<(?![=!])[^>]*>"), "(?:"), (re.compile(r"\\[pP]\{[^}]*\}"), "."))
_BOUNDS = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_REPEATS = tuple(getattr(sre, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(sre, name))


def pattern_cost(pattern: str) -> int:
    """About how large a grammar xgrammar writes `pattern` out to: one per character or
    class; a repetition of at most n (or, unbounded, at least n) times costs n times its
    part, and n times again where the part's own length varies within a bound (parts that
    run on, `x+`, are loops, cheap). A pattern Python's parser still does not read costs the
    product of its {m,n} counts (as if every one held the next)."""
    for form, same in _ECMA_FORMS:
        pattern = form.sub(same, pattern)
    try:
        return _cost(sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return math.prod(int(high) if high else int(low) for low, high in _BOUNDS.findall(pattern))


def _cost(items) -> int:
    total = 0
    for op, arg in items:
        if op in _REPEATS:
            low, high, part = arg
            count = max(low, 1) if high == sre.MAXREPEAT else high
            shortest, longest = part.getwidth()
            total += count * (count if shortest != longest < sre.MAXREPEAT else 1) * _cost(part)
        elif op is sre.SUBPATTERN:
            total += _cost(arg[-1])
        elif op is sre.BRANCH:
            total += sum(_cost(branch) for branch in arg[1])
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            total += _cost(arg[1])
        elif op is getattr(sre, "ATOMIC_GROUP", None):
            total += _cost(arg)
        elif op is not sre.AT:  # anchors cost nothing
            total += 1
    return total


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
