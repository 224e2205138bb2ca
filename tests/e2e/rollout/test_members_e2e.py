"""An elastic pool's membership (rollout/members.py) on a Ray cluster whose nodes come and go (Ray's own
cluster_utils, in a process of its own: this test process may hold another Ray cluster). Stand-in engines:
what is under test is who the members are. A node joins: its engine is admitted. Its node leaves under a
call (recover) or between steps (prune): dropped, counted, and a replacement waits for room. The last member
dies: the pool waits for a joining one, and with no room anywhere ends (EnginesLost), as it does when engines
crash on live nodes past cluster.max_restarts. The real engines on two `ray start` nodes: test_elastic_e2e.py."""

import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.e2e
POLLS = 240  # half-second polls for Ray to place an actor or count a node gone


class Pool:
    def __init__(self, workers):
        self.workers, self.calls_since_sync = workers, [0] * len(workers)


def scenario() -> None:
    import time

    import ray
    from ray.cluster_utils import Cluster

    from rollout.members import EnginesLost, Members
    from runtime.actors import ray_state

    @ray.remote
    class Engine:
        def ready(self) -> bool:
            return True

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"slot": 1}})
    ray.init(address=cluster.address, log_to_driver=False)
    try:

        def start():  # as RolloutPool starts an elastic pool's engines: never restarted by Ray
            return Engine.options(num_cpus=0, resources={"slot": 1}, max_restarts=0).remote()

        def joins(members) -> int:
            for _ in range(POLLS):
                if joined := members.admit():
                    return joined
                time.sleep(0.5)
            return 0

        first = start()
        ray.get(first.ready.remote())
        pool = Pool([first])
        fixed = Members(Pool([first]), start, 1, 1)
        assert fixed.joining == [] and fixed.prune(timeout_s=1) == 0  # a fixed pool starts nothing, drops nothing
        members = Members(pool, start, 1, 2, max_restarts=1)
        assert len(members.joining) == 1 and members.admit() == 0  # no room: waits

        node = cluster.add_node(num_cpus=1, resources={"slot": 1})  # a node joins: its engine is admitted
        assert joins(members) == 1
        joined = pool.workers[-1]
        assert pool.workers == [first, joined] and pool.calls_since_sync == [0, 0] and members.joined == 1
        assert members.joining == [] and members.nodes[joined._actor_id.hex()] == node.node_id

        cluster.remove_node(node)  # it leaves under a call (recover): dropped once Ray counts it gone
        assert members.recover(timeout_s=POLLS * 0.5) == 1
        assert pool.workers == [first] and len(pool.calls_since_sync) == 1 and members.left == 1
        assert joined._actor_id.hex() in members.departed and len(members.joining) == 1  # a replacement waits

        node = cluster.add_node(num_cpus=1, resources={"slot": 1})  # another joins, and leaves between steps
        assert joins(members) == 1 and len(pool.workers) == 2
        cluster.remove_node(node)
        for _ in range(POLLS):
            if members.prune(timeout_s=1):
                break
            time.sleep(0.5)
        assert pool.workers == [first] and members.left == 2 and members.joined == 2

        def dies(engine) -> None:
            ray.kill(engine)
            for _ in range(POLLS):  # until Ray says so: a ready call may still be answered just after the kill
                if ray_state(engine) == "DEAD":
                    return
                time.sleep(0.5)

        dies(first)  # the last member dies: below the min, the pool waits for a joining one (the head's room)
        assert members.recover(timeout_s=POLLS * 0.5) == 1 and len(pool.workers) == 1 and pool.workers != [first]
        assert (members.left, members.joined) == (3, 3)
        nowhere = Members(Pool([pool.workers[0]]), lambda: Engine.options(resources={"nowhere": 1}).remote(), 1, 2, 1)
        dies(pool.workers[0])  # and with no room anywhere for a joining one, the run ends (resumable)
        try:
            nowhere.recover(timeout_s=3)
            raise AssertionError("recover went on with no engine")
        except EnginesLost as e:
            assert "fewer than cluster.rollout_workers' min 1" in str(e) and nowhere.left == 1

        crashing = Engine.options(num_cpus=0).remote()  # crashes on a live node more often than max_restarts allows
        ray.get(crashing.ready.remote())
        budget = Members(Pool([crashing]), Engine.options(num_cpus=0).remote, 1, 2, max_restarts=0)
        dies(crashing)
        try:
            budget.recover(timeout_s=POLLS * 0.5)
            raise AssertionError("an engine crashed past cluster.max_restarts, and the pool replaced it")
        except EnginesLost as e:
            assert "died on live nodes 1 times, more than cluster.max_restarts (0)" in str(e)
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_node_that_joins_adds_an_engine_and_one_that_leaves_drops_it():
    out = subprocess.run(
        [sys.executable, "-c", "from tests.e2e.rollout.test_members_e2e import scenario; scenario()"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
