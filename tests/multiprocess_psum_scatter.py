"""Does jax-ml/jax#40830 affect this JAX? (Reported on jaxlib 0.12.0.dev20260920: under jax.distributed, XLA:CPU's
gloo reduce-scatter intermittently returns wrong values at the end of rank 0's result chunk for multi-MiB chunks.)

    python tests/multiprocess_psum_scatter.py PROCESS_ID PORT     (run as process 0 and 1 of one cluster)

2 processes x 4 CPU devices, gloo collectives; jax.lax.psum_scatter over groups of 8, 4 (one process's devices) and
2 (across the processes) with float64 result chunks of 16 KiB to 4 MiB, 5 iterations each, every chunk compared
with numpy. Prints "process I: N of M chunks wrong"; tests/test_multiprocess.py runs it in the slow tier.
"""
import sys
pid = int(sys.argv[1]); port = sys.argv[2]
import jax
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
wrong = total = 0
for axes, groups in ((("data", "model"), 8), (("model",), 4), (("data",), 2)):
    for chunk_kib in (16, 256, 1024, 4096):
        n = chunk_kib * 1024 // 8
        def f(x):
            return jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
        fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("data", "model")), out_specs=P(("data", "model")), check_vma=False))
        full_len = 8 * groups * n  # each device holds groups*n elements
        x = np.arange(full_len, dtype=np.float64) % 1000
        arr = jax.make_array_from_callback((full_len,), NamedSharding(mesh, P(("data", "model"))), lambda i: x[i])
        # expected: per device (d), block j of the group sum. Compute on host: devices in the same group sum.
        blocks = x.reshape(8, groups * n)  # device-local inputs, device order = mesh order
        dev = np.arange(8).reshape(2, 4)
        for it in range(5):
            out = fn(arr)
            for shard in out.addressable_shards:
                d = shard.index[0].start // n
                p, m = divmod(d, 4)
                if axes == ("data", "model"):
                    members, rank = list(range(8)), d
                elif axes == ("model",):
                    members, rank = list(dev[p]), m
                else:
                    members, rank = list(dev[:, m]), p
                expected = blocks[members].sum(axis=0)[rank * n:(rank + 1) * n]
                got = np.asarray(shard.data)
                total += 1
                if not np.array_equal(got, expected):
                    wrong += 1
                    bad = np.flatnonzero(got != expected)
                    print(f"process {pid}: groups of {groups}, {chunk_kib} KiB chunk, iteration {it}: device {d} (rank {rank}) {bad.size} wrong, {bad[0]}..{bad[-1]}", flush=True)
print(f"process {pid}: {wrong} of {total} chunks wrong", flush=True)
jax.distributed.shutdown()
