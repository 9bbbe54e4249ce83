"""The cattrs converter of client JSON, and the walk that turns its errors into a 400 naming the
field (the operator's view has its own, in :mod:`agentkv.snapshot`).

Client JSON is structured only here, at the edge, for all three APIs: the Anthropic shapes are in
:mod:`agentkv._anthropic`, the OpenAI ones next to their translations, which register their unions
with :func:`register_tagged`. The converter is strict about the *types* of known fields (cattrs
would otherwise turn ``1`` into ``"1"``) but ignores unknown keys, because the APIs keep growing
(``context_management``, ``output_config``, ...).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Literal, NewType, TypeVar, Union, get_args, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import AttributeValidationNote, IterableValidationNote
from cattrs.gen import make_dict_structure_fn

from agentkv._anthropic import ContentBlock, ImageSource, ToolChoice, ToolResultContent
from agentkv.exceptions import InvalidRequestError
from agentkv.schema import json_type

__all__ = [
    "AbsentIsNull",
    "FieldError",
    "NonEmptyStr",
    "PositiveInt",
    "Strings",
    "converter",
    "register_tagged",
    "structure",
]

T = TypeVar("T")
Hook = Callable[[Any, Any], Any]

# Narrower types, each checked as one value (see ``_strict`` below).
PositiveInt = NewType("PositiveInt", int)
NonEmptyStr = NewType("NonEmptyStr", str)
Strings = NewType("Strings", list[str])


class FieldError(ValueError):
    """A validation failure below the value being structured (``sub`` is appended to the path)."""

    def __init__(self, message: str, sub: str = "") -> None:
        super().__init__(message)
        self.sub = sub


class AbsentIsNull:
    """Base of the OpenAI shapes: a required field the client leaves out reads as null, so that
    its error is the type's own (``expected a string, got null``) rather than "field required"."""

    __slots__ = ()


def _strict(tp: Any, ok: Callable[[Any], bool], noun: str, *, got: bool = True) -> None:
    """Register a hook for ``tp`` that takes only what ``ok`` accepts (as ``tp``); the error
    names ``noun`` and, with ``got``, the JSON type it got."""

    def hook(value: Any, _: Any) -> Any:
        if not ok(value):
            raise FieldError(
                f"expected {noun}, got {json_type(value)}" if got else f"expected {noun}"
            )
        return float(value) if tp is float else value

    if get_origin(tp) is None:
        converter.register_structure_hook(tp, hook)
    else:  # a generic alias is no class to dispatch on
        converter.register_structure_hook_func(lambda t: t == tp, hook)


def _unknown_type(tag: Any, tags: tuple[str, ...]) -> str:
    return f"unknown type {tag!r}; expected one of {', '.join(repr(t) for t in tags)}"


def register_tagged(
    tp: Any,
    *,
    key: str = "type",
    read: Callable[[dict[str, Any]], Any] | None = None,
    unknown: Callable[[Any, tuple[str, ...]], str] | None = None,
    nested: Mapping[str, Any] | None = None,
) -> Hook:
    """Register (and return) the hook for ``tp``, a union of attrs classes or one class, told apart
    by their field ``key`` (its ``Literal`` values).

    ``read`` finds the tag where it is not simply ``value[key]``; ``nested`` maps more tags to types
    of their own (members of ``tp`` without the field, told apart by another). ``unknown`` words the
    error for a tag that fits none, missing included; without it a missing tag is "field required".
    """
    by_tag: dict[str, Any] = {
        tag: cls
        for cls in get_args(tp) or (tp,)
        if key in attrs.fields_dict(attrs.resolve_types(cls))
        for tag in get_args(attrs.fields_dict(cls)[key].type)
    }
    by_tag |= nested or {}
    tags = tuple(by_tag)
    # The class's own attrs hook, so that a hook registered on the class itself (a one-class
    # union) can dispatch here without calling itself.
    own = functools.cache(lambda cls: _attrs_factory(cls, converter))

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise FieldError(f"expected an object, got {json_type(value)}")
        if unknown is None and read is None and key not in value:
            raise FieldError("field required", key)
        tag = read(value) if read is not None else value.get(key)
        cls = by_tag.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise FieldError((unknown or _unknown_type)(tag, tags), key)
        if not attrs.has(cls):
            return converter.structure(value, cls)
        return own(cls)(value, cls)

    converter.register_structure_hook(tp, hook)
    return hook


def _is_str_or_list(tp: Any) -> bool:
    """``str | list[X]`` (optionally ``| None``): the "string or blocks" fields. A string it is
    ``Annotated`` with names the list in the error (``"a list of parts"``)."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) not in (Union, types.UnionType):
        return False
    args = get_args(tp)
    return str in args and any(get_origin(a) is list for a in args)


def _str_or_list(value: Any, tp: Any) -> Any:
    noun = "an array of blocks"
    if get_origin(tp) is Annotated:
        tp, noun = get_args(tp)
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        (list_type,) = [a for a in args if get_origin(a) is list]
        return converter.structure(value, list_type)
    raise FieldError(f"expected a string or {noun}, got {json_type(value)}")


def _is_literal(tp: Any) -> bool:
    return get_origin(tp) is Literal


def _is_list(tp: Any) -> bool:
    return get_origin(tp) is list


def _literal_factory(tp: Any) -> Hook:
    allowed = get_args(tp)
    expected = ", ".join(repr(a) for a in allowed)

    def hook(value: Any, _: Any) -> Any:
        if value not in allowed or isinstance(value, bool):
            raise FieldError(f"expected one of {expected}, got {value!r}")
        return value

    return hook


def _list_factory(tp: Any, conv: cattrs.Converter) -> Hook:
    # cattrs' own list hook iterates anything iterable, so a string would become a list of chars.
    inner = list_structure_factory(tp, conv)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, list):
            raise FieldError(f"expected an array, got {json_type(value)}")
        return inner(value, tp)

    return hook


def _attrs_factory(tp: Any, conv: cattrs.Converter) -> Hook:
    inner = make_dict_structure_fn(tp, conv)
    # A block's ``type`` tag is checked first, so ``{"type": "image"}`` where only text fits is
    # reported at ``.type`` rather than as a missing ``text``.
    tag_field = getattr(attrs.fields(tp), "type", None)
    tag = tag_field.default if tag_field is not None else None
    absent: dict[str, None] = {}
    if issubclass(tp, AbsentIsNull):
        absent = dict.fromkeys(a.name for a in attrs.fields(tp) if a.default is attrs.NOTHING)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise FieldError(f"expected an object, got {json_type(value)}")
        if isinstance(tag, str) and "type" in value and value["type"] != tag:
            raise FieldError(f"expected {tag!r}, got {value['type']!r}", "type")
        return inner({**absent, **value} if absent else value, tp)

    return hook


converter = cattrs.Converter(detailed_validation=True, forbid_extra_keys=False)
converter.register_structure_hook_factory(_is_literal, _literal_factory)
converter.register_structure_hook_factory(_is_list, _list_factory)
converter.register_structure_hook_factory(attrs.has, _attrs_factory)
_strict(str, lambda v: isinstance(v, str), "a string")
_strict(int, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
_strict(float, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number")
_strict(bool, lambda v: isinstance(v, bool), "a boolean")
_strict(dict[str, Any], lambda v: isinstance(v, dict), "an object")
converter.register_structure_hook_func(_is_str_or_list, _str_or_list)
_strict(PositiveInt, lambda v: type(v) is int and v > 0, "a positive integer", got=False)
_strict(NonEmptyStr, lambda v: isinstance(v, str) and v != "", "a non-empty string", got=False)
_strict(
    Strings,
    lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
    "a list of strings",
    got=False,
)
register_tagged(ContentBlock)
register_tagged(ToolResultContent)
register_tagged(ImageSource)
_tool_choice = register_tagged(ToolChoice)
converter.register_structure_hook(
    ToolChoice | None, lambda value, tp: None if value is None else _tool_choice(value, tp)
)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _leaves(exc: BaseException, path: str) -> Iterator[tuple[str, BaseException]]:
    """Every leaf error under a cattrs exception group, with the field path that leads to it."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    sub_path = _join(path, note.name)
                elif isinstance(note, IterableValidationNote):
                    sub_path = f"{path}[{note.index}]"
            yield from _leaves(sub, sub_path)
    elif isinstance(exc, FieldError):
        yield (_join(path, exc.sub) if exc.sub else path), exc
    else:
        yield path, exc


def structure(data: Mapping[str, Any], cls: type[T]) -> T:
    """Structure client JSON into ``cls``; a bad known field raises ``InvalidRequestError``.

    The first failing field is reported (like the Anthropic API, which names one field per 400).
    """
    if not isinstance(data, Mapping):
        raise InvalidRequestError(f"expected a JSON object, got {json_type(data)}")
    try:
        return converter.structure(dict(data), cls)
    except (cattrs.BaseValidationError, FieldError) as exc:
        path, leaf = next(_leaves(exc, ""), ("", exc))
        # Ours (FieldError) and cattrs' own messages (e.g. a value outside a Literal) read as they
        # are; a missing key is "field required".
        message = "field required" if isinstance(leaf, KeyError) else str(leaf)
        raise InvalidRequestError(message or type(leaf).__name__, path or None) from exc
