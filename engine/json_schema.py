"""What a JSON schema admits, checked before a grammar is built from it.

llguidance compiles a schema lazily: a schema whose every instance is infinite (an object that must hold
itself) compiles, and fails only once decoding reaches the recursion, with a request already streaming. So
a schema is checked here first, by the least fixed point of "this subschema has a finite instance" over its
`$ref`s: a subschema has one if the properties it requires and the items it needs have one. Conflicting
bounds, unknown keywords and the like are llguidance's to refuse when it compiles.

Two rewrites make schemas that mean something compile as they mean it:
- a `$ref` that only leads back to itself through other bare `$ref`s (`{"$ref": "#"}`) constrains nothing:
  it becomes `{}`, any JSON value;
- `rooted_at` moves a schema under another one (a tool's parameters inside a tool-call grammar), so that its
  root-relative references (`#/$defs/City`, how pydantic writes a nested model) still point where they did.
"""

from __future__ import annotations

import copy
from typing import Any

from engine.sampling import InvalidParameter

Schema = dict[str, Any] | bool
# Keywords that say something about a value without constraining it: a node of these and `$ref` is a bare ref.
ANNOTATIONS = frozenset({"$ref", "title", "description", "$comment", "examples", "default", "deprecated",
                         "readOnly", "writeOnly", "$id", "$schema", "$anchor"})
# Where a schema holds schemas: maps of them, lists of them, and single ones ("items" is either).
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
SCHEMA_VALUES = frozenset({"items", "additionalProperties", "additionalItems", "not", "if", "then", "else",
                           "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties"})


def checked(schema: Schema) -> Schema:
    """`schema` with its bare self-references as `{}`; InvalidParameter if no finite JSON value can match it."""
    try:
        schema = without_ref_loops(schema)
        finite = has_finite_instance(schema)
    except RecursionError:  # a schema nested hundreds deep: no one's real schema
        raise InvalidParameter("the JSON schema nests too deeply to be checked") from None
    if not finite:
        raise InvalidParameter("no finite JSON value matches it: every instance would have to contain "
                               "itself (a required property or item that refers back to its own schema)")
    return schema


def resolve(root: Schema, ref: str) -> tuple[str, Any] | None:
    """(the pointer, the subschema) that a local `$ref` ("#", "#/$defs/x") names in `root`; None if it names
    nothing here (a remote ref, a missing key: llguidance says what is wrong)."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return ref, node


def without_ref_loops(schema: Schema) -> Schema:
    """A copy of `schema` where each `$ref` whose chain of bare refs comes back to itself is dropped."""
    schema = copy.deepcopy(schema)

    def loops(ref: str) -> bool:
        seen = set()
        while ref not in seen:
            seen.add(ref)
            target = resolve(schema, ref)
            if target is None or not isinstance(target[1], dict) or not target[1].keys() <= ANNOTATIONS:
                return False
            ref = target[1].get("$ref")
            if not isinstance(ref, str):
                return False
        return True

    looping = [node for node in subschemas(schema) if isinstance(node.get("$ref"), str) and loops(node["$ref"])]
    for node in looping:  # dropped after the search, which must see every chain as it was
        del node["$ref"]
    return schema


def has_finite_instance(root: Schema) -> bool:
    """Whether some finite JSON value can match `root`, as far as required properties, needed items and
    `$ref`s decide (the least fixed point, from "no ref target has one")."""
    finite: dict[str, bool] = {}  # ref -> whether its target has a finite instance, so far
    targets: set[str] = set()

    def has(node: Any) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True  # not a schema: llguidance refuses it
        ref = node.get("$ref")
        if isinstance(ref, str) and resolve(root, ref) is not None:
            targets.add(ref)
            if not finite.get(ref, False):
                return False
        if "const" in node:
            return True
        if "enum" in node:
            return bool(node["enum"])
        if not all(has(s) for s in listed(node, "allOf")):
            return False
        for key in ("anyOf", "oneOf"):
            if listed(node, key) and not any(has(s) for s in listed(node, key)):
                return False
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types:  # no "type": a value of any type may match (a number has one)
            return True
        return any(has_type(node, t) for t in types)

    def has_type(node: dict, kind: Any) -> bool:
        # Malformed keywords (a list of properties, a string of minItems) count as absent: llguidance says what
        # is wrong with them.
        if kind == "object":
            properties = node["properties"] if isinstance(node.get("properties"), dict) else {}
            extra = node.get("additionalProperties", True)
            return all(has(properties.get(name, extra)) for name in listed(node, "required") if isinstance(name, str))
        if kind == "array":
            needed = node["minItems"] if isinstance(node.get("minItems"), int) else 0
            prefix, rest = listed(node, "prefixItems"), node.get("items", True)
            if isinstance(rest, list):  # draft-07's tuple form
                prefix, rest = rest, node.get("additionalItems", True)
            return all(has(s) for s in prefix[:needed]) and (needed <= len(prefix) or has(rest))
        return True

    while True:
        answer = has(root)
        changed = False
        for ref in sorted(targets):
            value = has(resolve(root, ref)[1])
            if value != finite.get(ref, False):
                finite[ref], changed = value, True
        if not changed:
            return answer


def listed(node: dict, key: str) -> list:
    """node[key] when it is a list, else nothing."""
    value = node.get(key)
    return value if isinstance(value, list) else []


def rooted_at(schema: Schema, pointer: str) -> Schema:
    """A copy of `schema` to be placed at `pointer` (e.g. "#/$defs/tool0") of another schema: every local
    `$ref` in it is prefixed with that pointer, so it names the same subschema there."""
    schema = copy.deepcopy(schema)
    for node in subschemas(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = pointer + ref[1:]
    return schema


def subschemas(schema: Schema) -> list[dict]:
    """Every subschema of `schema` that is an object, itself included, depth first; values that are data
    (`const`, `enum`, `default`) and property names are not schemas and are not visited."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found.append(node)
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in SCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key in SCHEMA_VALUES:
                stack.append(value)
    return found
