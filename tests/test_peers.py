"""accel.Peers: waiting for the slowest rank with a heartbeat through a store. Ranks are threads sharing one
HashStore here (the launcher's TCP store behaves alike); tests/test_faults.py stops and kills real ranks."""
import threading
import time

import pytest
import torch

from plumbing.accel import Peers, check_same_names

pytestmark = pytest.mark.spec


def ranks(world: int, timeout_s: float, poll_s: float = 0.05) -> list[Peers]:
    store = torch.distributed.HashStore()
    return [Peers(timeout_s, "t", store, r, world, "launch", poll_s) for r in range(world)]


def test_a_rank_that_keeps_beating_is_waited_for_past_the_timeout():
    """Rank 1 works 1.5 s, beating, with a timeout of 0.6 s: rank 0 waits for it and returns once it is done."""
    p0, p1 = ranks(2, 0.6)
    for p in (p0, p1):
        p.start(0)

    def work():
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            p1.last_beat = 0.0  # beat() throttles to once a second; the test beats faster than its timeout
            p1.beat()
            time.sleep(0.1)
        p1.wait("rollouts")
    t = threading.Thread(target=work)
    t.start()
    start = time.monotonic()
    p0.wait("rollouts")
    assert time.monotonic() - start >= 1.4
    t.join()


@pytest.mark.parametrize("world,silent", [(2, 1), (3, 2), (3, 0)])
def test_a_silent_rank_stops_every_rank_waiting_with_one_line_naming_it(world, silent):
    peers = ranks(world, 0.5)
    for p in peers:
        p.start(4)
    said = {}

    def wait(p):
        try:
            p.wait("rollouts")
        except SystemExit as e:
            said[p.rank] = (str(e), time.monotonic() - start)
    start = time.monotonic()
    waiters = [threading.Thread(target=wait, args=(p,)) for p in peers if p.rank != silent]
    for t in waiters:
        t.start()
    for t in waiters:
        t.join()
    assert sorted(said) == [r for r in range(world) if r != silent]
    for line, seconds in said.values():  # every waiting rank, after about the timeout
        assert line.startswith(f"t: step 5, rollouts: rank {silent} made no progress for 0.5 s") and seconds < 1.0


def test_a_rank_done_before_the_waiter_came_is_not_waited_for():
    p0, p1 = ranks(2, 0.3)
    for p in (p0, p1):
        p.start("eval")
    threading.Thread(target=p1.wait, args=("rollouts",)).start()
    time.sleep(0.1)
    p0.wait("rollouts")  # p1 is done (and waits for p0): both return


def test_keys_carry_the_launch_and_the_step_and_a_step_s_keys_go_at_the_next():
    store = torch.distributed.HashStore()
    old = Peers(1, "train", store, 0, 1, "first")
    new = Peers(1, "train", store, 0, 1, "second")
    old.start(3)
    store.add(old.key("claims"), 7)
    new.start(3)
    assert store.add(new.key("claims"), 0) == 0  # a restarted launch does not read an earlier attempt's counter
    new.beat()
    assert store.check([new.key("beat/0")])
    new.start(4)
    assert not store.check([new.key("beat/0", step=3)]) and store.check([old.key("claims")])


def test_one_process_has_nothing_to_wait_for():
    alone = Peers(0.1, "train")
    alone.start(0)
    alone.beat()
    alone.wait("rollouts")  # returns at once, no store


def test_metric_names_must_agree_over_ranks():
    check_same_names([["a", "b"], ["a", "b"]])
    with pytest.raises(SystemExit, match=r"mismatch/kl on rank\(s\) \[1\] only"):
        check_same_names([["a"], ["a", "mismatch/kl"], ["a"]])
    with pytest.raises(SystemExit, match="another order"):
        check_same_names([["a", "b"], ["b", "a"]])


def watched(world: int, timeout_s: float, silent: int, atexit_calls: list) -> tuple[list[Peers], dict]:
    """`world` ranks on one HashStore, every rank but `silent` watching (its stop records the line and parks the
    thread instead of ending the process); the silent rank entered step 3's update and then stopped beating."""
    import atexit
    peers, said = ranks(world, timeout_s), {}
    for p in peers:
        p.start(2)
        p.phase("update")

        def stop(line, abort, p=p):
            said[p.rank] = line
            threading.Event().wait()  # the thread stays, silent, as the process would be gone
        p.stop = stop
    real = atexit.register
    atexit.register = atexit_calls.append  # the test calls a rank's close itself
    try:
        for p in peers:
            if p.rank != silent:
                p.watch()
    finally:
        atexit.register = real
    return peers, said


@pytest.mark.parametrize("world,silent", [(2, 0), (3, 1)])
def test_the_watchdog_names_a_silent_rank_and_its_phase_on_every_live_rank(world, silent):
    _, said = watched(world, 0.5, silent, [])
    time.sleep(2.0)
    assert sorted(said) == [r for r in range(world) if r != silent]
    for line in said.values():
        assert line.startswith(f"t: step 3, update: rank {silent} made no progress for 0.5 s"), line


class CountingStore:
    """A store that counts its round trips, by operation (the watchdog's client on the launcher's TCP store)."""
    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return getattr(self.store, name)(*args)
        return call


@pytest.mark.parametrize("world", [4, 16])
def test_the_watchdog_reads_every_peer_in_one_multi_get_a_poll_whatever_the_world(world, monkeypatch):
    """After its first poll (an add of 0 per peer, which makes the counters of peers not started yet), a watchdog's
    poll is four round trips: its own beat, the stop and error checks, and one multi_get of every peer's counter."""
    import atexit
    from plumbing import accel
    # this process's own failure flag, clear (an entry point run in this process that exited with an error before
    # sets it, and a failed rank's watchdog skips the error check)
    monkeypatch.setattr(accel, "FAILED", threading.Event())
    peers, closes, said = ranks(world, 30.0), [], []
    counting = CountingStore(peers[0].store)
    peers[0].stop = lambda line, abort: said.append(line)  # a stop would end the test process (os._exit)
    real = atexit.register
    atexit.register = closes.append
    try:
        before = set(threading.enumerate())
        peers[0].watch(counting)
        thread, = set(threading.enumerate()) - before
        deadline = time.time() + 20.0  # polls of 0.05 s: 10 and more (fewer a second on a loaded machine)
        while len(counting.calls) < 4 + world - 1 + 11 * 4 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        atexit.register = real
        calls = list(counting.calls)
        for close in closes:
            close()  # the watchdog ends here, not 30 s later in another test, naming its silent peers
    thread.join(2.0)
    assert not thread.is_alive() and said == []
    poll = ["add", "check", "add", "multi_get"]  # beat, stop?, errors, every peer
    assert calls[:4 + world - 1] == ["set", "add", "check", "add"] + ["add"] * (world - 1)  # the first poll
    later = calls[4 + world - 1:]
    assert len(later) >= 10 * len(poll) and later[:len(later) // 4 * 4] == poll * (len(later) // 4), calls[-12:]


def test_the_watchdog_does_not_name_a_rank_that_ended_and_stops_at_once_for_one_that_failed():
    from plumbing import accel
    closes = []
    peers, said = watched(3, 0.5, 2, closes)
    peers[2].watched.set(peers[2].watch_key("gone/2"), "done")  # rank 2 ended normally
    time.sleep(1.5)
    assert said == {}
    accel.FAILED.set()
    try:
        closes[1]()  # rank 1 ends with an error: rank 0 stops at once, naming it
    finally:
        accel.FAILED.clear()
    time.sleep(0.5)
    assert list(said) == [0] and said[0].startswith("t: rank 1 ended with an error (its own lines say which), last "
                                                    "seen in step 3, update; rank 0 stops"), said


def agree(store, starts: list[tuple[int, float, float]]) -> dict:
    """accel.agree_attempt for (rank, start delay, wait) on threads sharing `store` (2 ranks): rank -> the attempt,
    or its one line."""
    from plumbing.accel import agree_attempt
    out = {}

    def go(rank, delay, wait):
        time.sleep(delay)
        try:
            out[rank] = agree_attempt(store, rank, 2, wait, 0.02)
        except SystemExit as e:
            out[rank] = str(e)
    threads = [threading.Thread(target=go, args=start) for start in starts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_ranks_agree_on_the_restart_attempt_through_the_store_not_their_own_counts():
    store = torch.distributed.HashStore()
    assert agree(store, [(0, 0.0, 2.0), (1, 0.3, 2.0)]) == {0: 1, 1: 1}  # the first start
    assert agree(store, [(1, 0.0, 2.0), (0, 0.3, 2.0)]) == {0: 2, 1: 2}  # both restarted, rank 1 first
    store.add("rstar2/attempt", 1)  # rank 0 started attempt 3 and died before rank 1 came; it starts again
    assert agree(store, [(1, 0.0, 2.0), (0, 0.3, 2.0)]) == {0: 4, 1: 4}
    said = agree(store, [(1, 0.0, 0.3)])  # rank 1 restarted alone: rank 0 never starts a new attempt
    assert said[1].startswith("process group: rank 1 restarted, and rank 0 started no new attempt of the group "
                              "within 0.3 s")
    said = agree(store, [(0, 0.0, 0.3)])  # rank 0 restarted alone
    assert said[0].startswith("process group: attempt 5: rank(s) 1 did not join within 0.3 s")

