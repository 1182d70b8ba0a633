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
    def from_kwargs(cls, kwargs: dict[str, Any], base: MethodOptions | None = None
                    ) -> MethodOptions:
        """Options from keyword values, by field name (``KVCacheConfig`` reads 0.1's
        names through ``compat`` first).

        ``None`` for an option whose default is not ``None`` means "the default" (also
        what ``key=none`` in a spec or flag parses to).
        """
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name not in defaults:
                names = cls.field_names()
                raise ConfigError(
                    f"unknown option {name!r} for method {cls.method!r}; " +
                    (f"its options are {names}" if names else "it has no options"))
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
