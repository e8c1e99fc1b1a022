"""A Ray head started by specd.ray_cluster comes up whatever port its GCS
draws. Ray fixes its dashboard agent's port (52365) inside the range that free
ports come from, and refuses to start a head whose GCS port is the same number
unless the agent's port is given as well (a CI run met it once)."""
import socket

import pytest

from specd import ray_cluster

pytestmark = pytest.mark.cluster

RAY_AGENT_DEFAULT = 52365


def test_a_head_whose_port_is_rays_default_agent_port_starts(tmp_path, monkeypatch):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", RAY_AGENT_DEFAULT))
        except OSError:
            pytest.skip(f"port {RAY_AGENT_DEFAULT} is in use on this machine")
    real = ray_cluster.free_ports

    def drawn(n):  # the GCS port first, as start_local_ray draws it
        others = [p for p in real(n) if p != RAY_AGENT_DEFAULT]
        return [RAY_AGENT_DEFAULT, *others[: n - 1]]

    monkeypatch.setattr(ray_cluster, "free_ports", drawn)
    address, pid = ray_cluster.start_local_ray(log_dir=str(tmp_path), timeout_s=60)
    try:
        assert address == f"127.0.0.1:{RAY_AGENT_DEFAULT}"
    finally:
        ray_cluster.stop_local_ray(pid)
