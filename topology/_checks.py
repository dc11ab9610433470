"""Argument checks shared by every layer: one wording for one kind of mistake."""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(owner: str, name: str, value) -> None:
    """Raise ``ValueError("{owner}: {name} must be a positive int, got ...")`` unless ``value`` is
    an integer >= 1."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def dtype_arg(owner: str, name: str, value) -> np.dtype:
    """``value`` as a numpy dtype (JAX's and ml_dtypes' included); raise
    ``TypeError("{owner}: {name} must be a dtype, got ...")`` for None or anything else."""
    try:
        if value is None:
            raise TypeError
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{owner}: {name} must be a dtype, got {value!r}") from None


def int_in_range(owner: str, name: str, value, lo: int, hi: int) -> None:
    """Raise ``ValueError("{owner}: {name} must be an int in [lo, hi], got ...")`` unless ``value``
    is an integer in ``[lo, hi]``."""
    if not is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{owner}: {name} must be an int in [{lo}, {hi}], got {value!r}")
