"""``rdzv_core.errors``: one naming rule, and the former names still import."""

from __future__ import annotations

import pytest

import rdzv_core
from rdzv_core import errors
from rdzv_core.kv import deadline


def test_every_error_class_ends_in_error() -> None:
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert classes and all(c.__name__.endswith("Error") for c in classes), [c.__name__ for c in classes]


@pytest.mark.parametrize("old, new", sorted(errors.OLD_NAMES.items()))
def test_a_former_name_is_the_same_class(old: str, new: str) -> None:
    assert getattr(errors, old) is getattr(errors, new)
    assert getattr(rdzv_core, old, getattr(errors, new)) is getattr(errors, new)


def test_a_bad_timeout_is_an_invalid_argument_not_a_bad_key() -> None:
    with pytest.raises(errors.InvalidArgumentError) as info:
        with deadline(-1):
            pass
    assert info.value.field == "timeout" and not isinstance(info.value, errors.InvalidKeyError)
    assert issubclass(errors.InvalidKeyError, errors.InvalidArgumentError)  # a bad key is a bad argument too
