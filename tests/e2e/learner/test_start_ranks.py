"""Starting the learner ranks survives the rendezvous port being taken between probe and bind."""

import pytest

from learner.group import start_ranks


def test_a_taken_rendezvous_port_is_retried_with_another_and_other_errors_are_raised(ray_cluster, tmp_path):
    class Rank:
        def __init__(self, rank, addr, port, threads, flag, error):
            if not flag.exists():  # the first rank 0 finds its port taken, as a racing process would cause
                flag.write_text(str(port))
                raise RuntimeError(error)
            self.port = port

        def ready(self):
            return self.port

    flag = tmp_path / "taken"
    ranks = start_ranks(
        Rank,
        1,
        lambda rank, addr, port, threads: (rank, addr, port, threads, flag, "EADDRINUSE: address already in use"),
    )
    assert ray_cluster.get(ranks[0].ready.remote()) > 0 and flag.exists()
    flag.unlink()
    with pytest.raises(ray_cluster.exceptions.RayActorError, match="out of memory"):
        start_ranks(Rank, 1, lambda rank, addr, port, threads: (rank, addr, port, threads, flag, "out of memory"))
