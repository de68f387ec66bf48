"""Reading the files a run is made of and leaves behind, each a ValueError of one line naming the file when it cannot
be read: a YAML recipe (:func:`load_recipe`, which follows ``base:``, through :func:`read_yaml`, which refuses a key
repeated in one mapping), and a run folder's JSON and JSON-lines files (:func:`read_json`, :func:`read_jsonl`).
"""

from __future__ import annotations

import json
import os

import yaml

from armor_trl.app.recipe.validation import kind_of


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader that refuses a key repeated in one mapping (plain PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` then overriding is YAML's own way
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first}); give each key once",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(path: str):
    """A YAML file through :class:`UniqueKeyLoader`; a ValueError of one line naming the file, line and column for
    a syntax error or a repeated key, and naming the file when it cannot be read."""
    try:
        with open(path) as f:
            return yaml.load(f, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        what = ": ".join(str(part) for part in (error.context, error.problem) if part)
        raise ValueError(f"{where}: invalid YAML: {what}.") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: invalid YAML: {' '.join(str(error).split())}.") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a text file ({error.reason} at byte {error.start}).") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror or error}).") from None


def load_recipe(path: str, _seen: tuple = ()) -> dict:
    """A YAML recipe as a dict. A ``base: other.yaml`` key (relative to the recipe) loads that recipe first and
    overrides its keys with this one's, so a variant states only what differs. Repeated keys and YAML syntax errors
    are refused with file, line and column."""
    path = os.path.abspath(path)
    if path in _seen:
        raise ValueError(f"Recipe {path} includes itself through 'base' ({' -> '.join(_seen + (path,))}).")
    recipe = read_yaml(path)
    recipe = {} if recipe is None else recipe
    if not isinstance(recipe, dict):
        raise ValueError(f"Recipe {path} must be a YAML mapping of field: value, got {kind_of(recipe)}.")
    base = recipe.pop("base", None)
    if base is None:
        return recipe
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f"Recipe {path}: base must be the file name of another recipe (a string, relative to this "
                         f"one), got {kind_of(base)} ({base!r}).")
    base_path = os.path.join(os.path.dirname(path), base)
    if not os.path.isfile(base_path):
        raise ValueError(f"Recipe {path}: base {base!r} not found (looked for {base_path}).")
    return {**load_recipe(base_path, _seen + (path,)), **recipe}


def read_json(path: str):
    """A JSON file's content; a ValueError naming the file (and where) when it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); the file "
                         "is corrupt or was cut short.") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a text file ({error.reason} at byte {error.start}).") from None


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file; a ValueError naming the file and line of a record that is not a JSON object
    (e.g. a line cut short when a run was killed)."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: line {number} is not valid JSON ({error.msg}, column {error.colno}); the "
                                 "file is corrupt or was cut short: repair or delete that line.") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {number} is not a JSON object ({{...}}), got {type(record).__name__}.")
            records.append(record)
    return records
