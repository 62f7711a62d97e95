"""The kept primary context on a real GPU: the closed session's device memory is freed and its pinned host
buffer kept registered while the context stays, the next session takes the same context and the same host
buffer over (``reuse``) and DMAs through them, and both are released after ``primary_keep`` (the primary made
anew by the driver)."""

from __future__ import annotations

import numpy as np

from cuctxd import Client
from tests.helpers import remove_tempdir, start_daemon, wait_until

MIB = 1 << 20


def primary(client: Client) -> dict[str, object]:
    return dict(client.status()["devices"][0]["primary_context"])


def test_the_kept_primary_is_taken_over_and_released() -> None:
    daemon = start_daemon("--primary-keep", "2", "--lease-ttl", "1", backend="cuda", ready_timeout=120)
    try:
        with Client(daemon.endpoint) as first:
            first.alloc(64 * MIB)
            host = first.host_alloc(8 * MIB, reuse=True)
            np.asarray(host)[:] = 7
            made = first.current_context()
            assert made is not None and made.is_primary
        with Client(daemon.endpoint) as second:
            state = primary(second)
            assert state["active"] is True and state["references"] == 0 and state["kept_for"], state
            assert second.status()["devices"][0]["memory"]["allocated"] == 0
            buffer = second.alloc(8 * MIB)
            assert second.status()["devices"][0]["host_kept"] == {"bytes": 8 * MIB, "buffers": 1}
            host = second.host_alloc(8 * MIB, reuse=True)
            assert int(np.asarray(host)[0]) == 7, "the kept buffer, as the first session left it"
            np.asarray(host)[:] = 3
            assert second.write(buffer, host) == 8 * MIB
            np.asarray(host)[:] = 0
            second.read_into(buffer, host)
            assert int(np.asarray(host).sum()) == 3 * 8 * MIB
            again = second.current_context()
            assert again is not None and again.context_id == made.context_id, "the kept context is taken over"
            host.free()
        with Client(daemon.endpoint) as observer:
            assert wait_until(lambda: primary(observer)["active"] is False, timeout=10), primary(observer)
            assert observer.status()["devices"][0]["host_kept"] == {"bytes": 0, "buffers": 0}
            observer.alloc(MIB)
            anew = observer.current_context()
            assert anew is not None and anew.context_id != made.context_id
    finally:
        code = daemon.stop(timeout=60)
        remove_tempdir(daemon.socket_dir)
    assert code == 0, f"cuctxd exited with {code}:\n{daemon.log()}"
