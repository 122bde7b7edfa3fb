"""The multi-host tier's fixture: simulated hosts (tests/hosts/netns.py), made for each test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.hosts.netns import Host, make_hosts, remove_hosts, why_no_hosts


@pytest.fixture
def hosts(request: pytest.FixtureRequest) -> Iterator[list[Host]]:
    """Hosts for one test (``@pytest.mark.hosts(n)``, 2 by default); gone after it."""
    why = why_no_hosts()
    if why is not None:
        pytest.skip(f"multi-host tier: {why}")
    marker = request.node.get_closest_marker("hosts")
    count = marker.args[0] if marker else 2
    tag = uuid.uuid4().hex[:5]
    made = make_hosts(count, tag)
    try:
        yield made
    finally:
        left = remove_hosts(made, tag)
    assert not left, f"still running at the test's end (killed): {left}"
