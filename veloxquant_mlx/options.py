"""Method options: one frozen dataclass per method, checked when it is built.

Each method declares its knobs (the paper's names where it has them) as a subclass of
``MethodOptions`` next to its cache class, with defaults and checks in one place
(``__post_init__``). ``KVCacheConfig`` holds one such object; the CLI derives its flags
from the fields. Errors name the method, the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

# Option names that 0.1's flat config shared between methods (no method prefix).
UNPREFIXED_01 = ("bits", "group_size", "window")


class ConfigError(ValueError):
    """A config or option field holds a value the method does not allow."""


def config_error(name: str, value: Any, allowed: str, owner: str = "KVCacheConfig") -> ConfigError:
    """The uniform error that names the field, the value and what is allowed."""
    return ConfigError(f"{owner}.{name}={value!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class MethodOptions:
    """Base of every method's options (a method without options uses it as is)."""

    # The registry sets this to the method name (used in error messages).
    method: ClassVar[str] = ""
    # Field names of the flat 0.1 ``KVCacheConfig`` that map to another field here.
    legacy_names: ClassVar[dict[str, str]] = {}

    # ---- checks for ``__post_init__`` ----
    def error(self, name: str, allowed: str) -> ConfigError:
        return config_error(name, getattr(self, name), allowed, self.method or type(self).__name__)

    def check_int(self, name: str, allowed: tuple[int, ...] | None = None,
                  minimum: int | None = None, optional: bool = False) -> None:
        """``name`` is an int (or None when ``optional``), in ``allowed``, >= ``minimum``."""
        value = getattr(self, name)
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, "an integer" + (" or None" if optional else ""))
        if allowed is not None and value not in allowed:
            raise self.error(name, f"one of {list(allowed)}")
        if minimum is not None and value < minimum:
            raise self.error(name, f"an integer >= {minimum}")

    def check_number(self, name: str, low: float, high: float, high_open: bool = False) -> None:
        """``name`` is a number in ``[low, high]`` (``[low, high)`` when ``high_open``)."""
        value = getattr(self, name)
        ok = (not isinstance(value, bool) and isinstance(value, (int, float))
              and not math.isnan(value) and low <= value
              and (value < high if high_open else value <= high))
        if not ok:
            raise self.error(name, f"a number in [{low}, {high}{')' if high_open else ']'}")

    def check_choice(self, name: str, choices: tuple[Any, ...]) -> None:
        if getattr(self, name) not in choices:
            raise self.error(name, f"one of {list(choices)}")

    def check_bool(self, name: str) -> None:
        if not isinstance(getattr(self, name), bool):
            raise self.error(name, "True or False")

    # ---- construction ----
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def resolve_name(cls, key: str) -> str | None:
        """The field ``key`` names: itself, a legacy name, or ``<method>_<field>``."""
        names = cls.field_names()
        if key in names:
            return key
        if key in cls.legacy_names:
            return cls.legacy_names[key]
        prefix = cls.method.split("_")[0] + "_"
        if key.startswith(prefix) and key[len(prefix):] in names:
            return key[len(prefix):]
        return None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], base: MethodOptions | None = None
                    ) -> MethodOptions:
        """Options from keyword values (legacy and prefixed names accepted).

        ``None`` for an option whose default is not ``None`` means "the default", as
        it did in 0.1.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            name = cls.resolve_name(key)
            if name is None:
                raise ConfigError(
                    f"unknown option {key!r} for method {cls.method!r}; its options are "
                    f"{cls.field_names() or 'none'}")
            if value is None and defaults[name] is not None:
                continue
            values[name] = value
        return dataclasses.replace(base, **values) if base is not None else cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def changed(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        default = type(self)()
        return {k: v for k, v in self.to_dict().items() if getattr(default, k) != v}
