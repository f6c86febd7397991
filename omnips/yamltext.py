"""YAML text for manifests, written without a YAML library: block mappings and sequences of
plain data. A string is left plain only where YAML cannot read it as anything else (a
number, a boolean, null, a flow collection); every other string is a JSON string, which
YAML reads as the same string."""

import json
import re

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
_SPECIAL = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"}


def scalar(value) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):  # no floats: JSON's 1e+100 is a string to YAML 1.1 readers
        return json.dumps(value)
    if isinstance(value, str):
        return value if _PLAIN.fullmatch(value) and value.lower() not in _SPECIAL else json.dumps(value)
    raise TypeError(f"no YAML scalar for {type(value).__name__}")


def dump(value, indent: int = 0) -> str:
    """`value` (dicts, lists, str, int, bool, None) as YAML lines ending in a newline."""
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return pad + "{}\n"
        out = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                # a sequence under a key is indented like the key's own entries
                out.append(f"{pad}{scalar(key)}:\n" + dump(item, indent + 2))
            else:
                out.append(f"{pad}{scalar(key)}: {_inline(item)}\n")
        return "".join(out)
    if isinstance(value, list):
        if not value:
            return pad + "[]\n"
        out = []
        for item in value:
            text = dump(item, indent + 2) if isinstance(item, (dict, list)) and item else f"{pad}  {_inline(item)}\n"
            out.append(pad + "- " + text[indent + 2:])  # the first line's indent becomes the dash
        return "".join(out)
    return pad + scalar(value) + "\n"


def _inline(value) -> str:
    if value == {} or value == []:
        return json.dumps(value)
    return scalar(value)


def dump_all(documents: list) -> str:
    return "".join("---\n" + dump(d) for d in documents)
