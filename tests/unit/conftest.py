"""Fixtures of the unit tier; modules with a `container` of their own override this one."""

import pytest

from tests.unit.runs_double import released_container


@pytest.fixture
def container(tmp_path):
    """A LocalHelperContainer holding a release of the fake trainer (tests/unit/runs_double.py)."""
    with released_container(tmp_path) as c:
        yield c
