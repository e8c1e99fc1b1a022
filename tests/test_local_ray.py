"""specd.ray_cluster.stop_local_ray on process groups shaped like a local
`ray start --block` (a child of this process leading its own group), without
Ray: the stop returns as soon as the group is gone, not after its timeouts."""
import os
import subprocess
import time

import pytest

from specd import ray_cluster

pytestmark = pytest.mark.unit


def group_gone(pgid: int, timeout_s: float = 5.0) -> bool:
    """Whether no process of the group is left (bounded wait: a member orphaned
    by the kill is a zombie until the system's init reaps it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_group_that_exits_on_sigterm_is_stopped_at_once():
    # The leader exits at once; until it is reaped its zombie keeps the group,
    # and a stop that did not reap it would wait out the whole timeout.
    pid = subprocess.Popen(["sleep", "60"], start_new_session=True).pid
    start = time.monotonic()
    ray_cluster.stop_local_ray(pid, timeout_s=10.0)
    assert time.monotonic() - start < 3.0
    assert group_gone(pid)


def test_a_leader_ignoring_sigterm_is_killed_after_the_timeout():
    pid = subprocess.Popen(["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"], start_new_session=True).pid
    time.sleep(0.3)  # the trap is set
    start = time.monotonic()
    ray_cluster.stop_local_ray(pid, timeout_s=1.0)
    took = time.monotonic() - start
    assert 1.0 <= took < 4.0, took
    assert group_gone(pid)
