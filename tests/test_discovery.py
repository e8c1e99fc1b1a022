"""Prometheus file-based service discovery as pure units: the status -> file_sd
JSON function (from the orchestrator's replica specs and from a Status reply
alike), the atomic writer, and the targets file following the pools as the
scaler changes them (a fake launcher; the real thing on Ray is tests/test_ray_e2e.py)."""
import asyncio
import json
import os

import pytest

from orchestrator.fleet.pool import Pool, ReplicaSpec
from orchestrator.fleet.scaling import Scaler
from orchestrator.fleet.discovery import TargetsFile
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.telemetry.discovery import dumps, file_sd_targets, write_atomic
from tests.test_pool import FakeClient, LocatingLauncher

pytestmark = pytest.mark.unit

SPECS = [
    ReplicaSpec("drafter", "specd-drafter-1", "10.0.0.2:7001", "n2", "10.0.0.2:9101"),
    ReplicaSpec("verifier", "specd-verifier-0", "10.0.0.1:7000", "n1", "10.0.0.1:9100"),
    ReplicaSpec("drafter", "specd-drafter-0", "10.0.0.2:7002", "n2", "10.0.0.2:9102"),
    ReplicaSpec("drafter", "drafter-9", "127.0.0.1:7003"),   # started by hand: no metrics address
]
WANT = [
    {"targets": ["10.0.0.9:9000"],
     "labels": {"job": "specd", "specd_kind": "orchestrator", "specd_replica": "specd-orchestrator"}},
    {"targets": ["10.0.0.1:9100"],
     "labels": {"job": "specd", "specd_kind": "verifier", "specd_replica": "specd-verifier-0"}},
    {"targets": ["10.0.0.2:9102"],
     "labels": {"job": "specd", "specd_kind": "drafter", "specd_replica": "specd-drafter-0"}},
    {"targets": ["10.0.0.2:9101"],
     "labels": {"job": "specd", "specd_kind": "drafter", "specd_replica": "specd-drafter-1"}},
]


def test_file_sd_targets_from_specs_and_from_a_status_reply():
    assert file_sd_targets(SPECS, "10.0.0.9:9000") == WANT
    status = pb.ClusterStatus(
        replicas=[pb.ReplicaStatus(kind=s.kind, name=s.name, address=s.address, metrics_address=s.metrics_address)
                  for s in SPECS],
        metrics_address="10.0.0.9:9000")
    assert file_sd_targets(status.replicas, status.metrics_address) == WANT
    # Nothing known (a stack started by hand): an empty list, still valid file_sd.
    assert file_sd_targets([SPECS[-1]]) == [] and json.loads(dumps([])) == []
    assert json.loads(dumps(WANT)) == WANT


def test_write_atomic_replaces_whole_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "sub" / "targets.json"
    write_atomic(path, dumps(WANT))                      # makes the directory
    assert json.loads(path.read_text()) == WANT
    inode = path.stat().st_ino
    write_atomic(path, dumps(WANT[:1]))
    assert json.loads(path.read_text()) == WANT[:1]
    assert path.stat().st_ino != inode                   # a new file renamed over it, not rewritten in place
    assert oct(path.stat().st_mode & 0o777) == "0o644"   # readable by a Prometheus running as another user
    assert os.listdir(path.parent) == ["targets.json"]   # no temporary file left

    with pytest.raises(TypeError):
        write_atomic(path, 42)                           # fails while writing the temporary file
    assert json.loads(path.read_text()) == WANT[:1]      # the old content stands
    assert os.listdir(path.parent) == ["targets.json"]


def test_targets_file_follows_the_pools(tmp_path):
    """Written at start; rewritten when the scaler adds, reaps, relocates or
    forgets a replica; an unchanged list is not rewritten."""
    async def run():
        pools = {"verifier": Pool("verifier"), "drafter": Pool("drafter")}
        for spec in SPECS[1:3]:
            pools[spec.kind].add(spec, FakeClient(spec))
        path = tmp_path / "targets.json"
        tf = TargetsFile(str(path), pools, "10.0.0.9:9000")

        def listed():
            return {g["labels"]["specd_replica"]: g["targets"][0] for g in json.loads(path.read_text())}
        assert listed() == {"specd-orchestrator": "10.0.0.9:9000", "specd-verifier-0": "10.0.0.1:9100",
                            "specd-drafter-0": "10.0.0.2:9102"}

        class Launcher(LocatingLauncher):
            async def start(self, kind):
                n = len(self.started)
                spec = ReplicaSpec(kind, f"specd-{kind}-{n + 5}", "h:1", "n", f"h:{9200 + n}")
                self.started.append(spec)
                return spec
        launcher = Launcher({})
        scaler = Scaler(pools, launcher, FakeClient, on_change=tf.update)
        await scaler.scale("drafter", 3)                 # two new ones, listed once they serve
        assert set(listed()) == {"specd-orchestrator", "specd-verifier-0", "specd-drafter-0", "specd-drafter-5",
                                 "specd-drafter-6"}
        inode = path.stat().st_ino
        await scaler.scale("drafter", 3)                 # no change: not rewritten
        assert path.stat().st_ino == inode

        await scaler.scale("drafter", 1)                 # drains two idle ones: listed until handed back
        assert len([n for n in listed() if "drafter" in n]) == 3
        await scaler.reap()
        assert [n for n in listed() if "drafter" in n] == ["specd-drafter-0"]

        d0 = pools["drafter"].replicas["specd-drafter-0"]
        Pool.mark_lost(d0, d0.client)
        launcher.where["specd-drafter-0"] = ReplicaSpec("drafter", "specd-drafter-0", "h:2", "n", "10.0.0.3:9999")
        await scaler.rediscover()                        # restarted elsewhere: the new port is listed
        assert listed()["specd-drafter-0"] == "10.0.0.3:9999"
        Pool.mark_lost(d0, d0.client)
        launcher.where["specd-drafter-0"] = "gone"
        await scaler.rediscover()                        # out of restarts: no longer listed
        assert "specd-drafter-0" not in listed()

        path.unlink()
        path.mkdir()                                     # now unwritable: logged, the scaler goes on
        await scaler.scale("drafter", 1)
        assert path.is_dir()
    asyncio.run(run())


def test_targets_file_unwritable_at_start_is_an_error(tmp_path):
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(OSError):
        TargetsFile(str(tmp_path / "dir.json"), {"verifier": Pool("verifier")}, "h:1")


def test_specd_up_targets_file_default_and_check(tmp_path, monkeypatch):
    """`specd up` puts the file in $SPECD_HOME unless told otherwise, and refuses
    a path it cannot write before anything starts, naming it."""
    from specd.cli import build_parser
    from specd.cli import deploy as cli

    monkeypatch.setenv("SPECD_HOME", str(tmp_path / "home"))
    args = build_parser().parse_args(["up"])
    assert cli._targets_file(args) == str(tmp_path / "home" / "prometheus_targets.json")
    cli._check_up_flags(args)                            # passes, and creates nothing
    assert not (tmp_path / "home").exists()
    (tmp_path / "taken.json").mkdir()
    args = build_parser().parse_args(["up", "--metrics-targets-file", str(tmp_path / "taken.json")])
    with pytest.raises(OSError, match="--metrics-targets-file .*taken.json: is a directory"):
        cli._check_up_flags(args)


def test_every_orchestrator_of_several_is_a_target():
    """Several orchestrators (each its own /metrics) come first, under their
    actor names, from the owner's list or from a Status reply's orchestrators."""
    orchestrators = [("specd-orchestrator", "10.0.0.9:9000"), ("specd-orchestrator-1", "10.0.0.9:9001")]
    got = file_sd_targets(SPECS, "ignored:1", orchestrators)
    assert got[0] == WANT[0] and got[2:] == WANT[1:]
    assert got[1] == {"targets": ["10.0.0.9:9001"],
                      "labels": {"job": "specd", "specd_kind": "orchestrator", "specd_replica": "specd-orchestrator-1"}}
