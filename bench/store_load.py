"""The load the ranks' watchdogs put on the launcher's TCP store, with the peers read one key at a time (old) or
with one multi_get a poll (new, plumbing/accel.py's `read_counters`).

    .venv/bin/python bench/store_load.py [--clients 64 128] [--seconds 4] [--poll 1.0]

One TCPStore server on 127.0.0.1 (torchrun's agent's is one such server), and per configuration `clients` threads,
each a watchdog with a store client of its own, polling every `--poll` seconds (a tenth of peer_timeout_s, at most
a second: 1 s for the default 600 s) for `--seconds` seconds. A poll makes the store operations `accel.watchdog`
makes: its own beat (add 1), the stop check, the error count (add 0), then every peer's counter: old, an add of 0
per peer, one round trip each; new, one multi_get of all of them (the first poll adds 0 to each, as both do, which
makes the counters of peers not started yet). Prints per configuration the store operations per second, the
operations per poll per client, and the time of the peer read (the old loop's single gets and the whole read;
the new multi_get), mean and 99th percentile, all after each client's first poll. Threads in one process, not 64 processes on 8 nodes: the clients
share this machine's cores and Python's lock between calls, so the latencies are an upper bound of the server's
and the operation counts are exact.
"""
import argparse
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plumbing.accel import read_counters  # noqa: E402


def old_read(store, keys: list[str], exist: bool, single: list[float]) -> list[int]:
    """The peers' counters one round trip each, as the watchdog read them before `read_counters`."""
    out = []
    for k in keys:
        t = time.perf_counter()
        out.append(store.add(k, 0))
        single.append(time.perf_counter() - t)
    return out


def client(port: int, me: int, world: int, loop: str, seconds: float, poll: float, start: threading.Barrier,
           stats: dict) -> None:
    """One watchdog's polls for `seconds`; stats[me] = (operations after the first poll, polls after it, their
    seconds, single-get times, peer-read times after it). The first poll is the same in both loops (an add per
    peer), so the steady state is what is compared."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    key = lambda what: f"{loop}/{world}/{what}"  # noqa: E731
    peers = [key(f"alive/{r}") for r in range(world) if r != me]
    ops, polls, single, reads, first, since = 0, 0, [], [], True, None
    start.wait()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.perf_counter()
        if not first and since is None:
            since = began  # counted from the second poll's start
        store.add(key(f"alive/{me}"), 1)
        store.check([key("stop")])
        store.add(key("errors"), 0)
        t = time.perf_counter()
        if loop == "old":
            old_read(store, peers, not first, [] if first else single)
        else:
            read_counters(store, peers, exist=not first)
        if first:  # the first poll: not counted
            first = False
        else:
            reads.append(time.perf_counter() - t)
            ops, polls = ops + 3 + (len(peers) if loop == "old" else 1), polls + 1
        time.sleep(max(0.0, poll - (time.perf_counter() - began)))
    stats[me] = (ops, polls, time.perf_counter() - since, single, reads)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(port: int, world: int, loop: str, seconds: float, poll: float) -> dict:
    stats, start = {}, threading.Barrier(world + 1)
    threads = [threading.Thread(target=client, args=(port, r, world, loop, seconds, poll, start, stats))
               for r in range(world)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    ops = sum(s[0] for s in stats.values())
    polls = sum(s[1] for s in stats.values())
    single = [x for s in stats.values() for x in s[3]]
    reads = [x for s in stats.values() for x in s[4]]
    return {"ops_s": sum(s[0] / s[2] for s in stats.values()), "ops_poll": ops / polls, "single": single,
            "reads": reads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 128], help="watchdogs (ranks) per configuration")
    ap.add_argument("--seconds", type=float, default=4.0, help="how long each configuration polls")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between a watchdog's polls")
    args = ap.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ms = lambda x: f"{1e3 * x:7.2f}"  # noqa: E731
    print(f"TCPStore on 127.0.0.1:{server.port}; a poll every {args.poll:g} s, {args.seconds:g} s per configuration")
    print(f"{'clients':>7} {'loop':>4} {'store ops/s':>11} {'ops/poll':>8} {'get mean ms':>11} {'get p99 ms':>10} "
          f"{'read mean ms':>12} {'read p99 ms':>11}")
    for world in args.clients:
        rows = {loop: run(server.port, world, loop, args.seconds, args.poll) for loop in ("old", "new")}
        for loop, r in rows.items():
            get = r["single"] if loop == "old" else r["reads"]  # new: the multi_get is the one get
            print(f"{world:>7} {loop:>4} {r['ops_s']:>11,.0f} {r['ops_poll']:>8.1f} {ms(sum(get) / len(get)):>11} "
                  f"{ms(percentile(get, 0.99)):>10} {ms(sum(r['reads']) / len(r['reads'])):>12} "
                  f"{ms(percentile(r['reads'], 0.99)):>11}")
        print(f"{world:>7} new/old store operations: {rows['new']['ops_s'] / rows['old']['ops_s']:.3f}")


if __name__ == "__main__":
    main()
