"""Settings shared by the dialect tests."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
# vLLM's RL suite talks to servers throughout, so it is slow; it stays as ported (not
# edited), so its mark is given here rather than in the module.
SLOW_MODULES = frozenset({"test_vllm_rlhf_suite.py"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of SLOW_MODULES slow (items of other directories are left alone)."""
    for item in items:
        if item.path.parent == HERE and item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
