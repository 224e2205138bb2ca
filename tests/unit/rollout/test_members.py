"""Members.recover on Ray's order of events (Ray itself stubbed): Ray marks a killed actor DEAD before its
process exits, so the ready call that recover waits on may still be answered by an engine that is dead. It
is dropped all the same, not kept as a member (the e2e scenario on a real cluster: tests/e2e/rollout/
test_members_e2e.py)."""

import pytest

from rollout import members as M


class Id:
    def __init__(self, name: str):
        self.name = name

    def hex(self) -> str:
        return self.name


class Engine:
    def __init__(self, name: str):
        self._actor_id = Id(name)


class Pool:
    def __init__(self, workers):
        self.workers, self.calls_since_sync = workers, [0] * len(workers)


@pytest.fixture
def ray_stub(monkeypatch):
    """Ray as Members reads it: every engine on the one live node, DEAD once in `dead`."""
    dead, killed = set(), []
    monkeypatch.setattr(M, "node_of", lambda engine: "node")
    monkeypatch.setattr(M, "alive_nodes", lambda: {"node"})
    monkeypatch.setattr(M, "ray_state", lambda engine: "DEAD" if engine._actor_id.hex() in dead else "ALIVE")
    monkeypatch.setattr(M.ray, "kill", lambda engine, no_restart=True: killed.append(engine._actor_id.hex()))
    monkeypatch.setattr(M.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(M.ray, "get", lambda ref: True)
    monkeypatch.setattr(M.watchdog, "restart_deadline", lambda: None)
    return dead, killed


def test_a_dead_engine_whose_ready_call_was_answered_is_dropped_and_replaced(ray_stub, monkeypatch):
    dead, killed = ray_stub
    spare = iter(Engine(f"joining{i}") for i in range(3))

    def start():
        engine = next(spare)
        engine.ready = type("Ready", (), {"remote": staticmethod(lambda: "ref")})
        return engine

    a, b = Engine("a"), Engine("b")
    pool = Pool([a, b])
    members = M.Members(pool, start, 1, 3, max_restarts=1)
    dead.add("b")
    monkeypatch.setattr(M, "await_ready", lambda workers, timeout_s, gone, may_lose: [])  # b answered, dead
    assert members.recover(timeout_s=1) == 1
    assert pool.workers == [a] and pool.calls_since_sync == [0] and "b" in members.departed and "b" in killed
    assert (members.left, members.crashed) == (1, 1)  # on a live node: a crash, counted against max_restarts
