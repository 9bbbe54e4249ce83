"""The cattrs converter of client JSON, and the walk that turns its errors into a 400 naming the
field (the operator's view has its own, in :mod:`agentkv.snapshot`).

Client JSON is structured only here, at the edge. The converter is strict about the *types* of known
fields (cattrs would otherwise turn ``1`` into ``"1"``) but ignores unknown keys, because the
Anthropic API keeps growing (``context_management``, ``output_config``, ...).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import AttributeValidationNote, IterableValidationNote
from cattrs.gen import make_dict_structure_fn

from agentkv._anthropic import (
    Base64ImageSource,
    ContentBlock,
    ImageBlock,
    ImageSource,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolResultContent,
    ToolUseBlock,
    UrlImageSource,
)
from agentkv.exceptions import InvalidRequestError
from agentkv.schema import json_type

__all__ = ["converter", "structure"]

T = TypeVar("T")


class _FieldError(ValueError):
    """A validation failure below the value being structured (``sub`` is appended to the path)."""

    def __init__(self, message: str, sub: str = "") -> None:
        super().__init__(message)
        self.sub = sub


def _strict_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise _FieldError(f"expected a string, got {json_type(value)}")
    return value


def _strict_int(value: Any, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _FieldError(f"expected an integer, got {json_type(value)}")
    return value


def _strict_float(value: Any, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _FieldError(f"expected a number, got {json_type(value)}")
    return float(value)


def _strict_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise _FieldError(f"expected a boolean, got {json_type(value)}")
    return value


def _json_object(value: Any, _: type) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _FieldError(f"expected an object, got {json_type(value)}")
    return value


def _tagged(classes: tuple[type[Any], ...]) -> Callable[[Any, Any], Any]:
    """A hook for a union of attrs classes told apart by their ``type`` default."""
    by_tag = {cls.__attrs_attrs__.type.default: cls for cls in classes}
    expected = ", ".join(repr(t) for t in by_tag)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise _FieldError(f"expected an object, got {json_type(value)}")
        if "type" not in value:
            raise _FieldError("field required", "type")
        tag = value["type"]
        cls = by_tag.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise _FieldError(f"unknown type {tag!r}; expected one of {expected}", "type")
        return converter.structure(value, cls)

    return hook


def _is_str_or_list(tp: Any) -> bool:
    """``str | list[X]`` (optionally ``| None``): the "string or blocks" fields."""
    if get_origin(tp) not in (Union, types.UnionType):
        return False
    args = get_args(tp)
    return str in args and any(get_origin(a) is list for a in args)


def _str_or_list(value: Any, tp: Any) -> Any:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        (list_type,) = [a for a in args if get_origin(a) is list]
        return converter.structure(value, list_type)
    raise _FieldError(f"expected a string or an array of blocks, got {json_type(value)}")


def _is_literal(tp: Any) -> bool:
    return get_origin(tp) is Literal


def _is_list(tp: Any) -> bool:
    return get_origin(tp) is list


def _literal_factory(tp: Any) -> Callable[[Any, Any], Any]:
    allowed = get_args(tp)
    expected = ", ".join(repr(a) for a in allowed)

    def hook(value: Any, _: Any) -> Any:
        if value not in allowed or isinstance(value, bool):
            raise _FieldError(f"expected one of {expected}, got {value!r}")
        return value

    return hook


def _list_factory(tp: Any, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    # cattrs' own list hook iterates anything iterable, so a string would become a list of chars.
    inner = list_structure_factory(tp, conv)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, list):
            raise _FieldError(f"expected an array, got {json_type(value)}")
        return inner(value, tp)

    return hook


def _attrs_factory(tp: Any, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    inner = make_dict_structure_fn(tp, conv)
    # A block's ``type`` tag is checked first, so ``{"type": "image"}`` where only text fits is
    # reported at ``.type`` rather than as a missing ``text``.
    tag_field = getattr(attrs.fields(tp), "type", None)
    tag = tag_field.default if tag_field is not None else None

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise _FieldError(f"expected an object, got {json_type(value)}")
        if isinstance(tag, str) and "type" in value and value["type"] != tag:
            raise _FieldError(f"expected {tag!r}, got {value['type']!r}", "type")
        return inner(value, tp)

    return hook


converter = cattrs.Converter(detailed_validation=True, forbid_extra_keys=False)
converter.register_structure_hook_factory(_is_literal, _literal_factory)
converter.register_structure_hook_factory(_is_list, _list_factory)
converter.register_structure_hook_factory(attrs.has, _attrs_factory)
converter.register_structure_hook(str, _strict_str)
converter.register_structure_hook(int, _strict_int)
converter.register_structure_hook(float, _strict_float)
converter.register_structure_hook(bool, _strict_bool)
converter.register_structure_hook_func(lambda tp: tp == dict[str, Any], _json_object)
converter.register_structure_hook_func(_is_str_or_list, _str_or_list)
converter.register_structure_hook(
    ContentBlock,
    _tagged(
        (
            TextBlock,
            ImageBlock,
            ToolUseBlock,
            ToolResultBlock,
            ThinkingBlock,
            RedactedThinkingBlock,
        )
    ),
)
converter.register_structure_hook(ToolResultContent, _tagged((TextBlock, ImageBlock)))
converter.register_structure_hook(ImageSource, _tagged((Base64ImageSource, UrlImageSource)))
_tool_choice = _tagged((ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone))
converter.register_structure_hook(ToolChoice, _tool_choice)
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
    elif isinstance(exc, _FieldError):
        yield (_join(path, exc.sub) if exc.sub else path), exc
    else:
        yield path, exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return "field required"
    if isinstance(exc, _FieldError):
        return str(exc)
    # cattrs' own messages (e.g. a value outside a Literal) are readable as they are.
    return str(exc) or type(exc).__name__


def structure(data: Mapping[str, Any], cls: type[T]) -> T:
    """Structure client JSON into ``cls``; a bad known field raises ``InvalidRequestError``.

    The first failing field is reported (like the Anthropic API, which names one field per 400).
    """
    if not isinstance(data, Mapping):
        raise InvalidRequestError(f"expected a JSON object, got {json_type(data)}")
    try:
        return converter.structure(dict(data), cls)
    except (cattrs.BaseValidationError, _FieldError) as exc:
        path, leaf = next(_leaves(exc, ""), ("", exc))
        raise InvalidRequestError(_describe(leaf), path or None) from exc
