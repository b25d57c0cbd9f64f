"""Racing create-only writes, shared by the storage contract and the S3 create tests."""

from __future__ import annotations

import threading

from jaxckpt.storage import PreconditionFailed, Storage


def race_to_create(hosts: list[Storage], key: str) -> list[bytes]:
    """Every host writes ``key`` create-only at once; returns the winners' payloads."""
    barrier = threading.Barrier(len(hosts))
    won: list[bytes] = []

    def create(host: Storage, payload: bytes) -> None:
        barrier.wait(timeout=60)
        try:
            host.write(key, payload, exclusive=True)
        except PreconditionFailed:
            return
        won.append(payload)

    threads = [
        threading.Thread(target=create, args=(host, f"host {i}".encode()))
        for i, host in enumerate(hosts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), f"a create-only write of {key} did not return within 60 s"
    return won
