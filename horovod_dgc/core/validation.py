"""Checks of configuration values, shared by every config class; each raises ValueError
naming the setting."""
from __future__ import annotations

import math
from typing import Optional


def require_fraction(name: str, value: float) -> None:
    """Raise ValueError unless ``0 < value <= 1``."""
    if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0 or math.isnan(value):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def require_open_fraction(name: str, value: float) -> None:
    """Raise ValueError unless ``0 < value < 1``."""
    if not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")


def require_momentum(name: str, value: float) -> None:
    """Raise ValueError unless ``0 <= value < 1``."""
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def require_non_negative(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not value >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def require_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def require_non_negative_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def require_choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def optional_positive(name: str, value: Optional[float]) -> None:
    if value is not None and (not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"{name} must be > 0 or None, got {value!r}")
