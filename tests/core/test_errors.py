"""``rdzv_core.errors``: one naming rule, and what the errors say."""

from __future__ import annotations

import pytest

from rdzv_core import errors
from rdzv_core.kv import call_deadline


def test_every_error_class_ends_in_error() -> None:
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert classes and all(c.__name__.endswith("Error") for c in classes), [c.__name__ for c in classes]


def test_a_bad_timeout_is_an_invalid_argument_not_a_bad_key() -> None:
    with pytest.raises(errors.InvalidArgumentError) as info:
        with call_deadline(-1):
            pass
    assert info.value.field == "timeout" and not isinstance(info.value, errors.InvalidKeyError)
    assert issubclass(errors.InvalidKeyError, errors.InvalidArgumentError)  # a bad key is a bad argument too


def test_a_long_value_is_cut_with_its_own_length() -> None:
    """A value too long to show is cut, with the value's length (129), not its quoted form's (131)."""
    from rdzv_core.errors import ConfigError

    message = str(ConfigError("rdzv_id", "x" * 129, "too long"))
    assert "(129 chars)" in message and len(message) < 300
