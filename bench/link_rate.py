"""What a node's link carries on the emulated cluster: one TCP stream between rank 0 and every other
rank at once, `--mb` MB each; rank 0 prints the aggregate payload rate (and writes it with --out).

Run with one rank per node under tools/emulate_cluster.py. With 2 nodes the stream is limited by
the sender's egress token bucket; with 3 or more, by the receiving node's bucket on the bridge side
(each sender alone could go at the full rate), and with --reverse by rank 0's own egress.

    .venv/bin/python tools/emulate_cluster.py --nodes 3 --rate 200mbit \\
        --command ".venv/bin/python bench/link_rate.py --mb 20"
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

CHUNK = 1 << 20


def send(sock: socket.socket, nbytes: int) -> None:
    buf = b"\0" * CHUNK
    while nbytes > 0:
        sock.sendall(buf[:min(CHUNK, nbytes)])
        nbytes -= CHUNK
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # the peer closes once it has everything: the time includes the last byte


def receive(sock: socket.socket, nbytes: int) -> None:
    while nbytes > 0:
        data = sock.recv(CHUNK)
        if not data:
            raise ConnectionError("peer closed early")
        nbytes -= len(data)
    sock.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=20.0, help="MB per stream")
    p.add_argument("--reverse", action="store_true", help="rank 0 sends to every other rank")
    p.add_argument("--port", type=int, default=5201)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nbytes = int(args.mb * 1e6)
    if rank != 0:
        for _ in range(200):  # rank 0 may not listen yet
            try:
                sock = socket.create_connection((os.environ["MASTER_ADDR"], args.port))
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise ConnectionError("rank 0 never listened")
        sock.sendall(b"go")
        (receive if args.reverse else send)(sock, nbytes)
        return 0
    server = socket.create_server(("", args.port), backlog=world)
    peers = []
    for _ in range(world - 1):
        conn, _ = server.accept()
        conn.recv(2)
        peers.append(conn)
    start = time.perf_counter()
    threads = [threading.Thread(target=send if args.reverse else receive, args=(conn, nbytes)) for conn in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    total = nbytes * (world - 1)
    result = {"streams": world - 1, "bytes": total, "seconds": round(elapsed, 3),
              "payload_bits_per_s": total * 8 / elapsed, "direction": "from rank 0" if args.reverse else "to rank 0"}
    print(f"{world - 1} stream(s) {result['direction']}: {total:,} B in {elapsed:.2f} s = "
          f"{result['payload_bits_per_s'] / 1e6:.0f} Mbit/s of payload")
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
