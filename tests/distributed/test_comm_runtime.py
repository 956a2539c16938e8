"""The runtime context: ``current_runtime`` / ``use_runtime`` / ``set_runtime`` (no process group needed)."""

from __future__ import annotations

import contextvars
import threading
from typing import Any, cast

import pytest

from dscore.errors import DscoreError
from dscore.runtime.context import current_runtime, peek_runtime, reset_runtime, set_runtime, use_runtime


def test_unset_runtime_is_a_clear_error() -> None:
    assert peek_runtime() is None
    with pytest.raises(DscoreError, match=r"no dscore runtime is active.*dscore.initialize"):
        current_runtime()


def test_use_runtime_nests_and_restores() -> None:
    a, b = cast(Any, object()), cast(Any, object())
    with use_runtime(a):
        assert current_runtime() is a
        with use_runtime(b):
            assert current_runtime() is b
        assert current_runtime() is a
    assert peek_runtime() is None


def test_set_and_reset_and_thread_isolation() -> None:
    rt = cast(Any, object())
    token = set_runtime(rt)
    try:
        seen: list[object] = []
        worker = threading.Thread(target=lambda: seen.append(peek_runtime()))
        worker.start()
        worker.join()
        assert seen == [None]  # a new thread starts without the runtime
        ctx = contextvars.copy_context()
        assert ctx.run(current_runtime) is rt  # a copied context carries it
    finally:
        reset_runtime(token)
    assert peek_runtime() is None
