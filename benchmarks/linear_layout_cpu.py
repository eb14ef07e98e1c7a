"""Dense `linear` at bench-preset shapes with the weight as stored ([N, K], contracted on K) against the transposed
[K, N] layout that weight preparation could give it; f32, min of 15 warm runs. Results in docs/benchmarks.md.

Run: python benchmarks/linear_layout_cpu.py
"""
import time, jax, jax.numpy as jnp, numpy as np
def bench(f, *a):
    f = jax.jit(f); f(*a).block_until_ready(); best=1e9
    for _ in range(15):
        t=time.perf_counter(); f(*a).block_until_ready(); best=min(best,time.perf_counter()-t)
    return best*1e3
rng=np.random.default_rng(0)
for T in (1, 8, 32, 128):
    for K, N in ((1024, 32000), (1024, 4096), (1024, 2048), (2048, 1024), (1024, 512)):
        x = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((N, K)), jnp.float32)
        wt = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
        a = bench(lambda x, w: jnp.einsum("tk,nk->tn", x, w), x, w)
        b = bench(lambda x, w: x @ w, x, wt)
        gb = N*K*4/1e9
        print(f"T {T:4d} K {K} N {N:6d}: [N,K] {a:7.3f} ms ({gb/a*1e3:5.1f} GB/s)  [K,N] {b:7.3f} ms ({gb/b*1e3:5.1f} GB/s)", flush=True)
