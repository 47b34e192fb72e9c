"""Fixtures for the compile tests: multi-rank pools shared by the whole session."""

import pytest

from tests._dist_pool import dist_pools as dist_pools  # the session's pools, for pool2/pool4


@pytest.fixture(scope="session")
def pool2(dist_pools):
    return dist_pools(2)


@pytest.fixture(scope="session")
def pool4(dist_pools):
    return dist_pools(4)
