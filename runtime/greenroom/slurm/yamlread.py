"""A YAML document read with the text a user wrote kept as text.

YAML 1.1 (PyYAML's) reads an unquoted 4:00:00 as the base-60 int 14400, 0022 as the
octal 18, 2.10 as the float 2.1 and 2024-01-01T10:00:00 as a datetime: a value's str()
is then not what the user wrote. Where a key takes text, such a plain scalar is read as
the text it is in the file; true, false and null keep their YAML meaning.
"""

from __future__ import annotations

import dataclasses
import types
import typing

import yaml

STR_TAG = "tag:yaml.org,2002:str"
NOT_TEXT_TAGS = {f"tag:yaml.org,2002:{kind}" for kind in ("int", "float", "timestamp")}


def alternatives(hint) -> tuple:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def keep_text(loader: yaml.SafeLoader, node: yaml.Node, hint) -> yaml.Node:
    """``node`` with its plain number and date scalars retagged as strings wherever
    ``hint``, the type of the field it fills, takes ``str`` (also as a list's items or a
    dict's values). A retagged scalar is a copy: an alias may use the original where a
    number belongs (``nodes: &n 2`` and ``env: {N: *n}``)."""
    options = alternatives(hint)
    if isinstance(node, yaml.ScalarNode):
        if str in options and node.style is None and node.tag in NOT_TEXT_TAGS:
            return yaml.ScalarNode(STR_TAG, node.value, node.start_mark, node.end_mark, style=node.style)
        return node
    origins = {typing.get_origin(option): option for option in options}
    if isinstance(node, yaml.SequenceNode) and list in origins:
        item = typing.get_args(origins[list])[0]
        node.value = [keep_text(loader, child, item) for child in node.value]
    elif isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)  # what a << merge brings in is checked here too
        classes = [option for option in options if dataclasses.is_dataclass(option)]
        if classes:
            fields = typing.get_type_hints(classes[0])
            node.value = [
                (
                    key,
                    keep_text(loader, value, fields[key.value])
                    if isinstance(key, yaml.ScalarNode) and key.value in fields
                    else value,
                )
                for key, value in node.value
            ]
        elif dict in origins:
            item = typing.get_args(origins[dict])[1]
            node.value = [(key, keep_text(loader, value, item)) for key, value in node.value]
    return node


def read_yaml(stream, hint):
    """``yaml.safe_load``, but a text key's plain scalar is read as written (``keep_text``),
    for a document that fills ``hint`` (a dataclass)."""
    loader = yaml.SafeLoader(stream)
    try:
        node = loader.get_single_node()
        return None if node is None else loader.construct_document(keep_text(loader, node, hint))
    finally:
        loader.dispose()
