"""One local Ray cluster for the scale-out tests (tests/support/ray_serve.py).

Ray is imported only by these fixtures, so the tests that need no cluster run without it;
the ones that do skip where Ray is not installed (`make test` installs it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.ray_serve import local_cluster


@pytest.fixture(scope="package")
def serve_url() -> Iterator[str]:
    """Ray Serve on a local cluster, its HTTP proxy on a free port; torn down after this
    package's last test, so that its daemons do not share the cores with the tests of the
    packages that run later."""
    pytest.importorskip("ray")
    with local_cluster() as url:
        yield url
