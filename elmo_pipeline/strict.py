"""What we read is validated and what we write is strict JSON.

- `parse_json_strict` refuses NaN, Infinity, numbers that overflow a float (1e999) and duplicate
  keys, and reports integers past Python's digit limit and nesting past its recursion limit as
  invalid JSON of that file; `dumps_strict` refuses to
  write a non-finite number, naming the file and key, so every JSON we write parses anywhere.
- `validated` checks parsed JSON against a pydantic model or type and turns pydantic's errors
  into one `ConfigError` line in the wording our files have always used:
  "config.json: lstm.dim: expected an integer, got True".
- `check_ints`, `check_bools` and `check_numbers` refuse, naming it, an argument given in Python
  (not read from a file) that is not of their type, where a function or class is called.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
import types
from typing import Any, Annotated, Mapping, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

FROM_FILE = "from_file"  # in the validation context of values read from a file: its name
_SHOWN_CHARS = 200  # a hostile file's huge value is cut in messages, not echoed whole

class ConfigError(ValueError):
    """A model configuration that cannot be used, with the file and the offending key in the message."""


# -- pydantic errors as messages --------------------------------------------------------------
# pydantic's own wording ("Input should be a valid integer") is replaced by the wording these
# files have always used; a type missing here keeps pydantic's message.
_EXPECTED = {
    "int_type": "expected an integer, got {input}",
    "bool_type": "expected true or false, got {input}",
    "string_type": "expected a string, got {input}",
    "float_type": "expected a number, got {input}",
    "finite_number": "expected a finite number, got {input}",
    "greater_than_equal": "must be >= {ge}, got {input}",
    "less_than_equal": "must be <= {le}, got {input}",
    "greater_than": "must be > {gt}, got {input}",
    "literal_error": "expected one of {expected}, got {input}",
    "model_type": "expected a JSON object, got {type}",
    "dict_type": "expected a JSON object, got {type}",
    "tuple_type": "expected a list, got {type}",
    "list_type": "expected a list, got {type}",
    "too_short": "expected at least {min_length} item(s), got {input}",
}
_FIELD_ERRORS = {"extra_forbidden": "unknown", "missing": "missing"}

Loc = tuple[Union[str, int], ...]


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...(cut)"


def problem(text: str) -> PydanticCustomError:
    """A validation error whose message is `text` as written (pydantic would prefix "Value error")."""
    return PydanticCustomError("config", "{text}", {"text": text})


def expecting(what: str) -> WrapValidator:
    """Any error inside the annotated value becomes one "expected `what`, got <value>" about it."""

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise problem(f"expected {what}, got {shown(value)}") from None

    return WrapValidator(check)


def _dotted(loc: Loc) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _model_in(kind: Any) -> type[BaseModel] | None:
    """The model class `kind` is, under Annotated or Optional, but not inside a container."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind
    origin = get_origin(kind)
    if origin is Annotated:
        return _model_in(get_args(kind)[0])
    if origin in (Union, types.UnionType):
        return next((m for m in map(_model_in, get_args(kind)) if m is not None), None)
    return None


def _model_at(kind: Any, loc: Loc) -> type[BaseModel] | None:
    """The model that validated the object at `loc` inside a value of type `kind`."""
    for part in loc:
        model = _model_in(kind)
        if model is not None and part in model.model_fields:
            kind = model.model_fields[part].annotation
        else:  # an item of a dict, list or tuple
            while get_origin(kind) is Annotated:
                kind = get_args(kind)[0]
            kind = (get_args(kind) or (None,))[-1]
    return _model_in(kind)


def _listed(names: list[str]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _expected_fields(model: type[BaseModel]) -> str:
    required = [name for name, info in model.model_fields.items() if info.is_required()]
    optional = [name for name in model.model_fields if name not in required]
    text = f"expected {_listed(required)}" if required else "expected"
    return f"{text} with optional {_listed(optional)}" if optional else text


def _error_text(error: Mapping[str, Any]) -> str:
    template = _EXPECTED.get(error["type"])
    if template is None:  # ours (`problem`) already say what they got
        return error["msg"]
    value = error["input"]
    return template.format(**error.get("ctx", {}), input=shown(value), type=type(value).__name__)


def _message(exc: ValidationError, kind: Any, where: str, path: Loc) -> str:
    """One line for all of pydantic's errors; unknown and missing keys are grouped by object."""
    fields: dict[Loc, dict[str, list[str]]] = {}
    values = []
    errors = exc.errors(include_url=False)
    # pydantic counts a list's length after dropping the items that failed: a list of one bad item
    # is also "too short", which the item's own error already explains
    inner = {tuple(e["loc"][:depth]) for e in errors for depth in range(len(e["loc"]))}
    for error in errors:
        if error["type"] == "too_short" and tuple(error["loc"]) in inner:
            continue
        loc = (*path, *error["loc"])
        if error["type"] in _FIELD_ERRORS and loc:
            fields.setdefault(loc[:-1], {}).setdefault(error["type"], []).append(str(loc[-1]))
        else:
            values.append((loc, _error_text(error)))
    keys = []
    for parent, names in fields.items():
        # unknown first: a misspelt key is also reported missing under its right name
        text = ", ".join(f"{word} field(s) {sorted(names[key])}" for key, word in _FIELD_ERRORS.items() if key in names)
        model = _model_at(kind, parent[len(path):])
        keys.append((parent, f"{text}; {_expected_fields(model)}" if model else text))
    return f"{where}: " + "; ".join(f"{_dotted(loc)}: {text}" if loc else text for loc, text in keys + values)


@functools.cache
def _adapter(kind: Any) -> TypeAdapter:
    return TypeAdapter(kind)


def validated(kind: Any, raw: Any, where: str, path: Loc = ()) -> Any:
    """`raw` (parsed JSON) validated as `kind` (a model or any type pydantic validates); a
    ConfigError names `where`, then `path` (where `raw` sits in its file) + the key."""
    try:
        return _adapter(kind).validate_python(raw, context={FROM_FILE: where})
    except ValidationError as exc:
        raise ConfigError(_message(exc, kind, where, path)) from exc


class StrictModel(BaseModel):
    """Frozen, no unknown fields. The constructor raises pydantic's ValidationError (a ValueError);
    values read from a file go through `validated`, for a ConfigError naming the file."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# -- arguments given in Python ------------------------------------------------------------------
def check_ints(**values: Any) -> None:
    """Raises TypeError naming the first of `values` that is not an int (a bool included): a float
    failed later, where `range`, a slice or torch refused it naming no argument, and True was
    taken as 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")


def check_bools(**values: Any) -> None:
    """Raises TypeError naming the first of `values` that is not a bool: a str such as "no" is true,
    so it was taken for True."""
    for name, value in values.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def check_numbers(**values: Any) -> None:
    """Raises TypeError naming the first of `values` that is not a real number (an int or float,
    numpy's too, or a 0-d tensor or array holding one, as a trained mix's `gamma` is; a bool
    excluded): a str failed at its first use in arithmetic, naming no argument."""
    for name, value in values.items():
        if not _is_real(value):
            raise TypeError(f"{name} must be a number, got {value!r}")


def _is_real(value: Any) -> bool:
    if isinstance(value, numbers.Real):
        return not isinstance(value, bool)
    # a 0-d torch tensor or numpy array, told by its shape (this module imports neither)
    return getattr(value, "shape", None) == () and callable(getattr(value, "item", None)) and _is_real(value.item())


def dumps_strict(value: Any, where: str, **options: Any) -> str:
    """json.dumps for everything we write: NaN and infinities are not JSON (parse_json_strict and
    strict parsers in other languages refuse them), so a value holding one is an error naming
    `where` and the key, not a file that other readers cannot parse; so is a string with a lone
    surrogate, which UTF-8 cannot encode (nor parse_json_strict read back as an escape). `options`
    go to json.dumps."""
    try:
        text = json.dumps(value, allow_nan=False, **options)
    except ValueError as exc:
        path = _non_finite_path(value)
        if path is None:
            raise
        raise ValueError(f"{where}: {path} is not a finite number, which JSON cannot hold") from exc
    # where the text may show a lone surrogate, the value is walked to find it: under
    # ensure_ascii=False it is written as itself; else as an escape "\ud..." (json writes lowercase),
    # which a character past U+FFFF also gives (a pair of them), and so do two lone ones side by side
    if (_WRITTEN_SURROGATE_ESCAPE in text) if options.get("ensure_ascii", True) else has_lone_surrogate(text):
        lone = _lone_surrogate_path(value)
        if lone is not None:  # a model's vocab.json failed to save with UnicodeEncodeError, naming no token
            raise ValueError(f"{where}: {lone} holds a lone surrogate, which no UTF-8 file can hold")
    return text


def _non_finite_path(value: Any, path: str = "") -> str | None:
    """Where the first NaN or infinity sits in a JSON-like value ("mixes.t.weights[0]")."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path or 'the value'} ({value})"
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    return next((found for key, item in items if (found := _non_finite_path(item, key)) is not None), None)


def parse_json_strict(text: str | bytes, where: str) -> Any:
    """json.loads that refuses NaN/Infinity, numbers too large for a float (1e999, which Python
    reads as infinity) and duplicate keys, naming the file (and the key) on failure."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"{where}: duplicate key {key!r}")
            out[key] = value
        return out

    def no_constants(name: str) -> Any:
        raise ConfigError(f"{where}: {name} is not valid JSON")

    overflowed: list[str] = []

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):  # found by key once the document is parsed
            overflowed.append(literal)
        return value

    try:
        value = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants, parse_float=finite)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # a binary file: not text at all
        raise ConfigError(f"{where}: not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise ConfigError(f"{where}: not valid JSON (nested too deeply to parse)") from exc
    except ValueError as exc:  # an integer of more digits than Python converts
        if isinstance(exc, ConfigError):
            raise
        reason = str(exc).split(";")[0]  # without Python's advice to raise its limit
        raise ConfigError(f"{where}: not valid JSON ({reason})") from exc
    if overflowed:
        raise ConfigError(f"{where}: {_non_finite_path(value)} is not a finite number: "
                          f"{shown(overflowed[0])} is beyond the range of a float")
    if _SURROGATE_ESCAPE.search(text if isinstance(text, str) else text.decode("utf-8", "replace")):
        lone = _lone_surrogate_path(value)  # a pair of escapes decodes to one character, which is fine
        if lone is not None:
            raise ConfigError(f"{where}: {lone} holds a lone surrogate escape, which is no Unicode character "
                              "(it cannot be written as UTF-8)")
    return value


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes and all


def check_json_items(data: bytes, limit: int, where: str, why: str) -> None:
    """Refuses, before it is parsed, the JSON document `data` when its arrays and objects hold more
    than `limit` items in all (`why` says whence the limit): parsed, each item costs some 30 times
    its bytes in Python objects (a 99 MB vocab.json took 3.2 GB and 35 s to be found longer than its
    config says). The items are counted as the commas outside strings, plus one, up to the limit, in
    UTF-8 (the JSON we write, and what UTF-16 or 32 is read as), whose multi-byte characters hold no
    quote or backslash byte."""
    if data.count(b",") < limit:  # commas inside strings too: there are no more items than this
        return
    encoding = json.detect_encoding(data)
    if not encoding.startswith("utf-8"):  # UTF-16 or 32, which json reads too: a character's bytes may hold a quote's
        try:
            data = data.decode(encoding).encode()
        except UnicodeError:  # not text: the parser names it
            return
    items, outside = 1, 0  # where the bytes outside the strings start again
    for string in _JSON_STRING.finditer(data):  # stops at the limit: a hostile file costs little
        items += data.count(b",", outside, string.start())
        if items > limit:
            break
        outside = string.end()
    else:
        items += data.count(b",", outside)
    if items > limit:
        raise ConfigError(f"{where}: holds more than the {limit:,} items {why}; refused unparsed")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_WRITTEN_SURROGATE_ESCAPE = "\\ud"  # how json.dumps starts every surrogate's escape (and a text's "\\ud")
_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """Whether `text` holds a code point that UTF-8 cannot encode (a lone surrogate)."""
    return not text.isascii() and _SURROGATE.search(text) is not None


def _lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Where the first string (key or value) holding a lone surrogate sits in a JSON-like value
    (a parsed document, or one to be written: tuples, keys that are not strings). A key's path is
    made only for a container or the string found: a dict of many strings is walked at about
    the speed of its search."""
    if isinstance(value, str):
        return (path or "the value") if has_lone_surrogate(value) else None
    if isinstance(value, dict):
        entries, at = value.items(), (lambda key: f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        entries, at = enumerate(value), (lambda i: f"{path}[{i}]")
    else:
        return None
    for key, item in entries:
        if isinstance(key, str) and has_lone_surrogate(key):  # a list's index is an int
            return f"the key {at(key)!r}"
        if isinstance(item, str):
            if has_lone_surrogate(item):
                return at(key)
        elif isinstance(item, (dict, list, tuple)) and (found := _lone_surrogate_path(item, at(key))) is not None:
            return found
    return None
