"""A 3-node Ray cluster on this machine (head + 2 workers, 1 CPU each), all of it on loopback.

CI installs Ray through the ``test`` extra, so these tests run there; without Ray they are skipped."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import pytest

pytest.importorskip("ray")

from rbpipe.service.ray import use_loopback  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    """``(cluster, {"head": node, "node_b": node, "node_c": node})``; the driver (this process) connected."""
    use_loopback()  # Ray binds to the interface address it detects; this keeps head, nodes and driver on lo
    import ray
    from ray.cluster_utils import Cluster

    # Ray keeps each session's logs under its temporary directory (/tmp/ray by default) after shutdown: ours goes
    # with the cluster (a short path: Ray's Unix sockets live under it, at most 107 characters). ``Cluster`` also
    # writes its address to ``$RAY_TMPDIR/ray/ray_current_cluster`` whatever ``temp_dir`` says, without creating
    # that directory (on a fresh machine /tmp/ray does not exist): RAY_TMPDIR points it into ours too
    temp_dir = tempfile.mkdtemp(prefix="rbpipe-ray-")
    os.makedirs(os.path.join(temp_dir, "ray"))
    env = pytest.MonkeyPatch()
    env.setenv("RAY_TMPDIR", temp_dir)
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"head": 1}, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "temp_dir": temp_dir})
        try:
            nodes = {"head": cluster.head_node}
            for name in ("node_b", "node_c"):
                nodes[name] = cluster.add_node(num_cpus=1, resources={name: 1}, node_ip_address="127.0.0.1")
            ray.init(address=cluster.address, _node_ip_address="127.0.0.1",
                     namespace=f"rbpipe-tests-{uuid.uuid4().hex[:6]}", logging_level="WARNING")
            yield cluster, nodes
        finally:
            ray.shutdown()
            cluster.shutdown()
    finally:
        env.undo()
        shutil.rmtree(temp_dir, ignore_errors=True)
