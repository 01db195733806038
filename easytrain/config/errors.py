"""The error every config rule raises: one line naming the dotted key, its value, the problem and the fix."""

from __future__ import annotations

from typing import Any, Optional

NO_VALUE: Any = object()
"""Pass as a ConfigError's value when the key has no single value to show."""


class ConfigError(ValueError):
    """A config value that cannot work; ``str(err)`` is one line for the user."""

    def __init__(self, key: str, value: Any, problem: str, fix: str = "") -> None:
        self.key, self.value, self.problem, self.fix = key, value, problem, fix
        shown = _show(value)
        message = f"{key}={shown}: {problem}" if shown is not None else f"{key}: {problem}"
        super().__init__(f"{message}; {fix}" if fix else message)

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a Ray worker, it reaches the driver as itself
        return _rebuild, (str(self), self.key, self.problem, self.fix)


def _rebuild(message: str, key: str, problem: str, fix: str) -> ConfigError:
    err = ConfigError.__new__(ConfigError)
    ValueError.__init__(err, message)
    err.key, err.value, err.problem, err.fix = key, NO_VALUE, problem, fix
    return err


def _show(value: Any) -> Optional[str]:
    if value is NO_VALUE:
        return None
    if isinstance(value, str):
        return repr(value)
    return str(value).replace("\n", " ")
