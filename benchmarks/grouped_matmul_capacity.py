"""Measures a capacity-layout grouped matmul ([E, C, K] gathered rows, one batched einsum, C = the smallest power of
two ≥ the largest group, chosen at run time by lax.switch) against grouped_matmul_cpu, at bench-preset MoE shapes.
Run: python benchmarks/grouped_matmul_capacity.py (results in docs/benchmarks.md)."""
import time, jax, jax.numpy as jnp, numpy as np
from qcompile.kernels import grouped_matmul as gm

def capacity_gmm(rows, w, group_sizes):
    E, Nout, K = w.shape; N = rows.shape[0]
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(group_sizes)[:-1].astype(jnp.int32)])
    caps = []
    c = 1
    while c < N: caps.append(c); c *= 2
    caps.append(N)
    def branch(C):
        def f(rows, w):
            idx = offsets[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
            valid = jnp.arange(C)[None, :] < group_sizes[:, None]
            x = jnp.where(valid[..., None], jnp.take(rows, jnp.clip(idx, 0, N - 1), axis=0), 0)
            y = jnp.einsum("eck,enk->ecn", x, w, preferred_element_type=jnp.float32)
            tgt = jnp.where(valid, idx, N).reshape(-1)
            return jnp.zeros((N, Nout), jnp.float32).at[tgt].set(y.reshape(-1, Nout), mode="drop").astype(rows.dtype)
        return f
    biggest = jnp.max(group_sizes)
    which = jnp.searchsorted(jnp.array(caps), biggest)
    return jax.lax.switch(which, [branch(C) for C in caps], rows, w)

rng = np.random.default_rng(0)
for tokens in (1, 8, 32, 64, 128):
    for K, Nout in ((1024, 256), (256, 1024)):
        N = tokens * 8
        ids = np.stack([rng.choice(64, 8, replace=False) for _ in range(tokens)]).ravel()
        gs = jnp.asarray(np.bincount(ids, minlength=64).astype(np.int32))
        rows = jnp.asarray(rng.standard_normal((N, K)).astype(np.float32))
        w = jnp.asarray(rng.standard_normal((64, Nout, K)).astype(np.float32) * 0.03)
        res = {}
        for name, fn in (("cpu", gm.grouped_matmul_cpu), ("capacity", capacity_gmm)):
            f = jax.jit(fn); out = f(rows, w, gs).block_until_ready()
            best = 1e9
            for _ in range(7):
                t = time.perf_counter(); f(rows, w, gs).block_until_ready(); best = min(best, time.perf_counter() - t)
            res[name] = (best * 1e3, out)
        err = float(jnp.abs(res["cpu"][1] - res["capacity"][1]).max() / jnp.abs(res["cpu"][1]).max())
        print(f"tokens {tokens:4d} K {K} cpu {res['cpu'][0]:7.2f} ms  capacity {res['capacity'][0]:7.2f} ms  maxgroup {int(gs.max())} err {err:.1e}")
