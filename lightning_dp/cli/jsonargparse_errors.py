"""The key and the reason of a jsonargparse error, read back from its message: :func:`read_error` walks the indented
tree jsonargparse prints (keys along the way make the path; the first bullet of a class type of a union, the reason).
A ``class_path`` that cannot be imported is reported under that ``class_path`` key, with the class types the option
takes (to suggest an importable one).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

UNION = "Does not validate against any of the Union subtypes"

_PARSER_KEY = re.compile(r'Parser key "([^"]+)":(.*)', re.DOTALL)
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)':(.*)", re.DOTALL)
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted.*", re.DOTALL)
_DOES_NOT_ACCEPT = re.compile(r"(Subcommand|Group) '([^']+)' does not accept option '([^']+)'")
_EXPECTED = re.compile(r"Expected a <class '([\w.]+)'>(?:\. Got value: (.*))?", re.DOTALL)
_GIVEN_VALUE = re.compile(r"^Given value: (.*)$", re.MULTILINE)
_GIVEN_CLASS = re.compile(r"^Given value: Namespace\(class_path='([^']+)'", re.MULTILINE)
_SUBTYPES = re.compile(r"^\s*Subtypes: (.*)$", re.MULTILINE)
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_NOT_IMPORTED = re.compile(r"module '[\w.]+' has no attribute '\w+'|No module named '[\w.]+'.*", re.DOTALL)
#: the given value is the class path itself, or a list holding it: the key is the option's, without ``.class_path``
_GIVEN_WHOLE = re.compile(r"^Given value type: <class '(list|str)'>", re.MULTILINE)
_PATH_OR_UNION = "- Expected a path but "


@dataclass(frozen=True)
class ReadError:
    """What a jsonargparse error is about.

    Attributes:
        key: the full dotted path of the option (``trainer.strategy.init_args.max_grad_norm``); ``""`` when the
            message names none (a class whose constructor failed).
        reason: what is wrong, on one line.
        class_path: the innermost class whose arguments hold the key (or whose constructor failed), if any.
        unknown: the option does not exist (``reason`` is then ``"unknown option"``).
        missing_class: a ``class_path`` given that cannot be imported (``reason`` is then why; ``key`` ends in
            ``.class_path``, or is the list's key for an item of a list).
        bases: the dotted names of the class types the option takes (with ``missing_class``).
    """

    key: str
    reason: str
    class_path: str | None = None
    unknown: bool = False
    missing_class: str | None = None
    bases: tuple[str, ...] = ()


def read_error(message: str) -> ReadError:
    """Read the key and the reason out of a jsonargparse error ``message``; a message of another form is kept whole,
    on one line, as the reason."""
    return _read(message, [], None)


def _read(text: str, keys: list[str], class_path: str | None) -> ReadError:
    text = text.strip()
    if match := _PARSER_KEY.fullmatch(text):
        return _read(_body(match.group(2)), [*keys, match.group(1)], class_path)
    if text.startswith(_PATH_OR_UNION) and (union := text.find(f"- {UNION}")) > 0:  # a string: a file or a class
        return _read(text[union + 2 :], keys, class_path)
    if match := _CLASS_PATH.fullmatch(text):
        return _read(_body(match.group(2)), [*keys, "init_args"], match.group(1))
    if text.startswith(UNION) and (bullets := _bullets(text)):
        expected = [match.group(1) for bullet in bullets if (match := _EXPECTED.fullmatch(bullet))]
        if len(expected) < len(bullets):  # the error of the first type that applies (jsonargparse tries it first)
            chosen = next(bullet for bullet in bullets if not _EXPECTED.fullmatch(bullet))
            if (match := _CLASS_PATH.fullmatch(chosen)) and _NOT_IMPORTED.fullmatch(reason := _body(match.group(2))):
                subtypes = _SUBTYPES.search(text)
                bases = tuple(dict.fromkeys(_DOTTED.findall(subtypes.group(1)))) if subtypes else ()
                key = ".".join(keys if _GIVEN_WHOLE.search(text) else [*keys, "class_path"])
                return ReadError(key, " ".join(reason.split()), missing_class=match.group(1), bases=bases)
            given = _GIVEN_CLASS.search(text)
            return _read(chosen, keys, class_path or (given.group(1) if given else None))
        value = _GIVEN_VALUE.search(text)
        got = value.group(1) if value else "another type"
        return ReadError(".".join(keys), f"expected {' or '.join(map(_type_name, expected))}, got {got}")
    if match := _NOT_ACCEPTED.fullmatch(text):
        return ReadError(".".join([*keys, match.group(1)]), "unknown option", class_path, unknown=True)
    if match := _DOES_NOT_ACCEPT.fullmatch(text):  # a subcommand's key is the full path; a group's, below its name
        prefix = [match.group(2)] if match.group(1) == "Group" else []
        return ReadError(".".join([*keys, *prefix, match.group(3)]), "unknown option", class_path, unknown=True)
    if (match := _EXPECTED.fullmatch(text)) and match.group(2) is not None:
        return ReadError(".".join(keys), f"expected {_type_name(match.group(1))}, got {match.group(2)}", class_path)
    return ReadError(".".join(keys), " ".join(text.split()), class_path)


def _body(rest: str) -> str:
    """The text under a ``Parser key "...":`` or ``Problem with given class_path '...':`` header: what follows the
    colon on its line, then the indented lines below, dedented."""
    first, _, below = rest.partition("\n")
    return f"{first.strip()}\n{textwrap.dedent(below)}".strip()


def _bullets(union: str) -> list[str]:
    """The ``- ...`` items of a union error's ``Errors:`` section, each dedented and on as many lines as it had."""
    lines = union.splitlines()
    if "Errors:" not in lines:
        return []
    section = []
    for line in lines[lines.index("Errors:") + 1 :]:
        if line and not line[0].isspace():
            break
        section.append(line)
    items: list[list[str]] = []
    for line in textwrap.dedent("\n".join(section)).splitlines():
        if line.startswith("- "):
            items.append([line[2:]])
        elif items:
            items[-1].append(line[2:] if line.startswith("  ") else line)
    return ["\n".join(item).strip() for item in items]


def _type_name(name: str) -> str:
    """``"float"`` for jsonargparse's ``<class 'float'>``, ``"None"`` for ``NoneType``."""
    return "None" if name == "NoneType" else name.rsplit(".", 1)[-1]
