"""A setting: a config field declared once, and the TOML key, flag, environment variable and checks derived from it.

``setting(...)`` declares a field's bounds, choices and flag name beside its type and default; ``derive_settings``
reads them back, with the docstring under each field, as ``Setting`` values, which the config file, the command line
(cli/options.py) and ``validate`` all use. This module knows no particular section: config.py declares them.

It imports nothing heavy (no torch, no hivemind): the CLI reads it to build --help, which must start at once.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import sys
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad config value or file; the message names the field and the fix."""


def setting(default: Any = MISSING, *, factory: Any = MISSING, flag: Optional[str] = None,
            at_least: Optional[float] = None, above: Optional[float] = None, below: Optional[float] = None,
            choices: Optional[Sequence[str]] = None, file: bool = False, fix: Optional[str] = None) -> Any:
    """A config field and what the flag, the environment variable and ``validate`` need to know about it beyond its
    type and default: ``flag`` where it is not the field's name (``--matchmaking-time`` for matchmaking_time_s, the
    unit dropped), bounds (``at_least`` inclusive, ``above``/``below`` exclusive; of each item of a list), ``choices``,
    ``file`` (a path to a file: --help shows FILE) and ``fix``, said after a bound's error."""
    metadata = dict(flag=flag, at_least=at_least, above=above, below=below, choices=choices, file=file, fix=fix)
    return field(default=default, default_factory=factory, metadata=metadata)



@dataclass(frozen=True)
class Setting:
    """One setting as the config file, the command line and the environment name it, derived from its field."""

    key: str
    """the TOML key, the name errors use: diloco.local_steps (run_id at the top level)"""
    flag: str
    """the flag, e.g. --local-steps (a bool's also has a --no- form)"""
    env: str
    """the environment variable, e.g. P2PTRAIN_LOCAL_STEPS; a list's items are separated by spaces there"""
    type: type
    """int, float, str or bool: of the value, or of each item of a list"""
    many: bool
    """a list: the flag is repeatable"""
    optional: bool
    """None (unset) is a value"""
    default: Any
    doc: str
    """the docstring under the field, on one line"""
    at_least: Optional[float] = None
    above: Optional[float] = None
    below: Optional[float] = None
    choices: Optional[Tuple[str, ...]] = None
    file: bool = False
    fix: Optional[str] = None

    @property
    def help(self) -> str:
        """The doc as --help shows it: a sentence."""
        text = self.doc[:1].upper() + self.doc[1:]
        text += "" if text.endswith(".") else "."
        return text + " Repeatable." if self.many else text

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with ``value`` for this setting, in the words of a one-line error; None if nothing."""
        if value is None:
            return None
        for item in value if self.many else [value]:
            if self.choices is not None and item not in self.choices:
                return f"{self.key} {item!r} is unknown; use one of: {', '.join(self.choices)}"
            if self.type is float and not math.isfinite(item):
                return f"{self.key} must be a finite number, got {value}"
            low_ok = ((self.at_least is None or item >= self.at_least) and (self.above is None or item > self.above))
            if low_ok and (self.below is None or item < self.below):
                continue
            if self.below is not None:
                low = f"[{self.at_least}" if self.above is None else f"({self.above}"
                bound = f"in {low}, {self.below})"
            elif self.above is not None:
                bound = "positive" if self.above == 0 else f"above {self.above}"
            else:
                bound = f"at least {self.at_least}"
            return f"{self.key} must be {bound}, got {value}" + (f"; {self.fix}" if self.fix else "")
        return None

    def coerce(self, value: Any, source: str) -> Any:
        """Check a value against the setting's declared type, with the one-line message the user needs."""
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{source}: {self.key} cannot be empty")
        if not self.many:
            return self._coerce_one(value, value, source)
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {self.key} must be a list, got {value!r}")
        return [self._coerce_one(item, value, source) for item in value]

    def _coerce_one(self, item: Any, value: Any, source: str) -> Any:
        if self.type is float and isinstance(item, int) and not isinstance(item, bool):
            return float(item)
        if self.type is not bool and isinstance(item, bool) or not isinstance(item, self.type):
            name = self.type.__name__
            kind = f"{'an' if name == 'int' else 'a'} {name}" if not self.many else f"a list of {name}"
            raise ConfigError(f"{source}: {self.key} must be {kind}, got {value!r}")
        return item



def derive_settings(root: type, sections: Mapping[str, type]) -> Tuple[Setting, ...]:
    """Every setting of the dataclass ``root``, in the order of the fields: its own (a section's field left out), then
    each of ``sections`` ({"swarm": SwarmConfig, ...}: the fields of ``root`` that hold one) in turn."""
    docs = _field_docs(root)
    found = []
    for section, cls in [("", root), *sections.items()]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not section and f.name in sections:
                continue
            kind, optional = hints[f.name], False
            if typing.get_origin(kind) is typing.Union:  # Optional[X]
                (kind,), optional = [a for a in typing.get_args(kind) if a is not type(None)], True
            many = typing.get_origin(kind) is list
            kind = typing.get_args(kind)[0] if many else kind
            meta = f.metadata
            flag = meta.get("flag") or "--" + f.name.removesuffix("_s").replace("_", "-")
            choices = meta.get("choices")
            found.append(Setting(
                key=f"{section}.{f.name}" if section else f.name, flag=flag,
                env="P2PTRAIN_" + flag[2:].replace("-", "_").upper(), type=kind, many=many, optional=optional,
                default=f.default if f.default is not MISSING else f.default_factory(),
                doc=docs.get((cls.__name__, f.name), ""), at_least=meta.get("at_least"), above=meta.get("above"),
                below=meta.get("below"), choices=tuple(choices) if choices else None, file=meta.get("file", False),
                fix=meta.get("fix"),
            ))
    return tuple(found)


def _field_docs(root: type) -> Dict[Tuple[str, str], str]:
    """{(class name, field name): the docstring under the field, on one line}, read from the source of ``root``'s
    module (Python keeps no such docstring at run time). Without the source (a frozen build), the help texts are
    empty."""
    try:
        tree = ast.parse(Path(sys.modules[root.__module__].__file__).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):  # pragma: no cover
        return {}
    docs = {}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for node, after in zip(cls.body, cls.body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[(cls.name, node.target.id)] = " ".join(after.value.value.split())
    return docs



def read_toml(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing TOML file to --config")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML ({e}); fix the syntax at that spot") from None
