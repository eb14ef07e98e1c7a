"""Several processes, one mesh: `jax.distributed` on this host's CPUs (gloo collectives), and reading a step's
outputs back when no process holds all of them.

`--coordinator HOST:PORT --num-processes N --process-id I` (run, bench) start one of N cooperating processes: they
first meet on PORT + 1 (process 0 listens; a process that never comes is a one-line error after --join-timeout, not
JAX's abort), then each gives JAX mesh-size / N CPU devices, selects gloo for the cross-process collectives and joins
the coordinator (process 0 serves it on PORT) before anything touches a device. `jax.devices()` then lists every process's devices, process
0's first, so a `--mesh 2x4` mesh's outer axis is the process and its inner axis the devices of one process. Every
process runs the same program on the same inputs (the scheduler is deterministic), each holding only its own blocks
of the sharded weights, caches and outputs: `to_host` gathers an output every process needs (the next tokens).
"""

from __future__ import annotations

import io
import os
import re
import socket
import sys
import time

import attrs
import numpy as np

from qcompile.errors import UsageError
from qcompile.ir.lowering import whole_view

_ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:(\d{1,5})$")
#: seconds a process waits for the others to join before it gives up (never a hang)
JOIN_TIMEOUT_S = 120


@attrs.frozen
class Cluster:
    coordinator: str
    num_processes: int
    process_id: int
    join_timeout_s: float = JOIN_TIMEOUT_S

    @property
    def host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.coordinator.rsplit(":", 1)[1])

    @classmethod
    def from_options(cls, coordinator: str | None, num_processes: int | None, process_id: int | None,
                     join_timeout_s: float = JOIN_TIMEOUT_S):
        """The cluster the three options name (None when none is given); a clear usage error when they disagree."""
        given = [v is not None for v in (coordinator, num_processes, process_id)]
        if not any(given):
            return None
        if not all(given):
            raise UsageError("--coordinator, --num-processes and --process-id go together (e.g. --coordinator "
                             "127.0.0.1:12355 --num-processes 2 --process-id 0, and --process-id 1 in the other)")
        match = _ADDRESS.match(coordinator)
        if not match or not 0 < int(match.group(1)) < 65536:
            raise UsageError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
        if num_processes < 1:
            raise UsageError(f"--num-processes must be at least 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise UsageError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
        if int(match.group(1)) == 65535:
            raise UsageError("--coordinator PORT must be below 65535 (PORT + 1 is used to gather the processes)")
        if not join_timeout_s > 0:
            raise UsageError(f"--join-timeout must be positive, got {join_timeout_s}")
        return cls(coordinator, num_processes, process_id, join_timeout_s)

    def devices_per_process(self, mesh_size: int) -> int:
        if mesh_size % self.num_processes:
            raise UsageError(f"a mesh of {mesh_size} devices does not split over {self.num_processes} processes; "
                             f"give --mesh a multiple of {self.num_processes} (e.g. {self.num_processes}x4)")
        return mesh_size // self.num_processes

    def join(self, mesh_size: int) -> None:
        """Give this process its share of the mesh's CPU devices and join the others (before JAX starts)."""
        import jax

        local = self.devices_per_process(mesh_size)
        self._gather()
        _results_only_on_stdout()
        try:
            jax.config.update("jax_num_cpu_devices", local)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(self.coordinator, num_processes=self.num_processes,
                                       process_id=self.process_id, initialization_timeout=int(self.join_timeout_s))
        except RuntimeError as err:
            raise UsageError(f"process {self.process_id} of {self.num_processes} could not join the coordinator at "
                             f"{self.coordinator}: {str(err).splitlines()[0]} (start every process within "
                             f"{JOIN_TIMEOUT_S} s, each with its own --process-id, all with one --coordinator, in "
                             "fresh processes)") from None
        found = len(jax.devices())
        if found != mesh_size:
            raise UsageError(f"the {self.num_processes} processes hold {found} devices together; the mesh needs "
                             f"{mesh_size}")


    def _gather(self) -> None:
        """Wait, up to the join timeout, until every process is running (on PORT + 1, before jax.distributed): JAX's
        coordination client aborts the whole process, with a C++ stack trace, when a peer never registers, so a
        missing process is found here first and reported in one line."""
        address = (self.host, self.port + 1)
        deadline = time.monotonic() + self.join_timeout_s
        missing = (f"(start every process within --join-timeout {self.join_timeout_s:g} s, each with its own "
                   f"--process-id, all with --coordinator {self.coordinator})")
        if self.num_processes == 1:
            return
        if self.process_id == 0:
            joined: dict[int, socket.socket] = {}
            with socket.create_server(address, reuse_port=False) as server:
                while len(joined) < self.num_processes - 1:
                    server.settimeout(max(deadline - time.monotonic(), 0.01))
                    try:
                        peer, _ = server.accept()
                    except (TimeoutError, socket.timeout):
                        absent = sorted(set(range(1, self.num_processes)) - set(joined))
                        raise UsageError(f"process(es) {', '.join(map(str, absent))} of {self.num_processes} did not "
                                         f"join {missing}") from None
                    peer.settimeout(self.join_timeout_s)
                    other = int(peer.recv(16).decode() or -1)
                    if other in joined or not 0 < other < self.num_processes:
                        raise UsageError(f"two processes claim --process-id {other} (or it is out of range) {missing}")
                    joined[other] = peer
                for peer in joined.values():
                    peer.sendall(b"go")
                    peer.close()
            return
        while True:
            try:
                with socket.create_connection(address, timeout=1.0) as conn:
                    conn.sendall(str(self.process_id).encode())
                    conn.settimeout(max(deadline - time.monotonic(), 0.01) + 5)
                    if conn.recv(2) == b"go":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise UsageError(f"process {self.process_id} could not reach process 0 at {self.host}:{self.port + 1} "
                                 f"{missing}")
            time.sleep(0.2)


def _results_only_on_stdout() -> None:
    """gloo (inside XLA) prints "[Gloo] Rank i is connected to n peer ranks" on the process's native stdout each time
    it sets up a group; a command's results go to stdout, so native stdout is pointed at stderr and Python's
    sys.stdout keeps writing to the original."""
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(os.fdopen(original, "wb", buffering=0), encoding=sys.stdout.encoding or "utf-8",
                                  line_buffering=True, write_through=True)


def to_host(array) -> np.ndarray:
    """The whole value of a step output as a numpy array, in every process: as it is when this process holds all of
    it, else gathered from the processes that hold its blocks."""
    return whole_view(array)


def is_leader() -> bool:
    """Whether this process reports results (process 0; the only one without jax.distributed)."""
    import jax

    return jax.process_index() == 0
