"""A delaying TCP relay: adds round-trip latency where `tc netem` is not available.

    python -m dflash_ops.testing.relay --to 10.1.2.11:22 --rtt 0.1   # prints "port N", serves

Every chunk read from one side is written to the other `rtt / 2` seconds after it arrived,
in order, in both directions (so a round trip gains `rtt`); an end of stream travels the same
way. It runs as its own process so its work never competes with the client it measures.
"""

from __future__ import annotations

import argparse
import queue
import socket
import sys
import threading
import time

CHUNK = 64 * 1024


def _pipe(src: socket.socket, dst: socket.socket, delay: float) -> None:
    pending: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            pending.put((time.monotonic() + delay, data))
            if not data:
                return

    threading.Thread(target=read, daemon=True).start()
    while True:
        due, data = pending.get()
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        try:
            if not data:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(data)
        except OSError:
            return


def _serve(client: socket.socket, upstream: tuple[str, int], delay: float, connect_timeout: float) -> None:
    try:
        server = socket.create_connection(upstream, timeout=connect_timeout)
    except OSError:
        client.close()
        return
    server.settimeout(None)
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    there = threading.Thread(target=_pipe, args=(client, server, delay), daemon=True)
    there.start()
    _pipe(server, client, delay)
    there.join()
    client.close()
    server.close()


def serve(listen: tuple[str, int], upstream: tuple[str, int], rtt: float, connect_timeout: float = 30.0) -> None:
    with socket.create_server(listen) as sock:
        print(f"port {sock.getsockname()[1]}", flush=True)
        while True:
            client, _addr = sock.accept()
            threading.Thread(target=_serve, args=(client, upstream, rtt / 2, connect_timeout), daemon=True).start()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="relay")
    parser.add_argument("--listen", type=_address, default=("127.0.0.1", 0))
    parser.add_argument("--to", type=_address, required=True)
    parser.add_argument("--rtt", type=float, required=True, help="added round-trip time in seconds")
    args = parser.parse_args(argv)
    serve(args.listen, args.to, args.rtt)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
