"""Grouped matmul (the MoE expert matmul) for the CPU backend.

`grouped_matmul(rows[N,K], w[E,Nout,K], group_sizes[E]) -> [N,Nout]`: rows are token-expert rows already sorted by
expert, group e owns the consecutive rows [off[e], off[e] + group_sizes[e]) with off the exclusive cumsum; rows from
sum(group_sizes) on are padding. Every function here computes rows_g · w[e]ᵀ with f32 accumulation and returns
rows.dtype; padding rows come back 0.

Why: the reference rule, `jax.lax.ragged_dot`, is expanded by JAX 0.10.2 on CPU into a dense product of every row with
every expert (E× the FLOPs and an [E,N,Nout]-sized temporary): on the bench preset one MoE layer took 0.55 s at 4
tokens. The strategies below do work proportional to N (plus one block per routed expert), never to E×N:

- `grouped_matmul_blocks_loop`: rows are cut into blocks of `block` rows that never straddle two experts (a group of
  g rows takes ceil(g/block) blocks); a `lax.while_loop` runs only over the blocks actually used, each one
  dynamic_slice of `block` rows times its expert's weight slice w[e] ([out, in] layout, contracted on `in`; XLA
  materialises the dynamically indexed slice, one weight copy per block) and written back with
  dynamic_update_slice. Rows of a block past its group's end are computed with the wrong
  expert but are overwritten by the next group's blocks (blocks run in row order), or zeroed at the end when they are
  padding. Weight bytes read = one expert slice per block.
- `grouped_matmul_blocks_batched`: the same block table, but all blocks at once: a static block count
  nb = ceil(N/block) + min(E, N) - 1 (an upper bound on Σ ceil(g_e/block)), rows gathered into [nb, block, K],
  weights gathered per block into [nb, Nout, K] and one batched einsum; each row then takes its result back with a
  gather. Costs a copy of nb weight slices (unused blocks included).
- `grouped_matmul_experts_unrolled`: a static Python loop over the E experts, each under `lax.cond(g_e > 0)` with a
  while-loop over its blocks; the weight slice has a static index, so XLA does not copy it per block. Fast (and the
  only fast bf16 form), but E conditionals cost 4-30 s of XLA compile per call site at E=64 (4-5 s on a quiet machine).
- `grouped_matmul_rowwise`: each row times its own expert's weight (a per-row weight gather [N, Nout, K] and a
  batched matvec). Best at N ≤ 8, collapses from N=32 on.

`grouped_matmul_cpu` chooses one per static shape (see the rule and the table it came from there).

Measured (docs/cpu_rules.md, section "grouped_matmul", has the commands, the reading of the table and the
precision check): `python benchmarks/grouped_matmul_cpu.py`, jax 0.10.2 CPU, 2 shared cores, E=64, top-8 random
routing, N = tokens*8; minimum over repeats and over three runs; GB/s = bytes of the experts' weights actually hit
÷ time; **bold** = what `grouped_matmul_cpu` picks.

| dtype | matrix | tokens | N | experts hit | strategy | ms | GB/s | GFLOP/s | first call s |
|---|---|---|---|---|---|---|---|---|---|
| f32 | gate/up | 1 | 8 | 8 | reference ragged_dot | 80.837 | 0.1 | 0.1 | - |
| f32 | gate/up | 1 | 8 | 8 | loop b1 | 0.637 | 13.2 | 6.6 | - |
| f32 | gate/up | 1 | 8 | 8 | loop b4 | 1.001 | 8.4 | 4.2 | - |
| f32 | gate/up | 1 | 8 | 8 | loop b8 | 0.996 | 8.4 | 4.2 | 1.24 |
| f32 | gate/up | 1 | 8 | 8 | batched b8 | 1.049 | 8.0 | 4.0 | 0.74 |
| f32 | gate/up | 1 | 8 | 8 | **rowwise** (chosen) | 0.515 | 16.3 | 8.1 | 0.27 |
| f32 | gate/up | 1 | 8 | 8 | experts b1 | 0.416 | 20.2 | 10.1 | 17.91 |
| f32 | gate/up | 4 | 32 | 27 | reference ragged_dot | 121.961 | 0.2 | 0.1 | - |
| f32 | gate/up | 4 | 32 | 27 | **loop b1** (chosen) | 1.672 | 16.9 | 10.0 | 1.21 |
| f32 | gate/up | 4 | 32 | 27 | loop b4 | 3.696 | 7.7 | 4.5 | - |
| f32 | gate/up | 4 | 32 | 27 | loop b8 | 3.039 | 9.3 | 5.5 | 0.82 |
| f32 | gate/up | 4 | 32 | 27 | loop b16 | 7.487 | 3.8 | 2.2 | - |
| f32 | gate/up | 4 | 32 | 27 | loop b32 | 6.598 | 4.3 | 2.5 | - |
| f32 | gate/up | 4 | 32 | 27 | batched b8 | 27.094 | 1.0 | 0.6 | - |
| f32 | gate/up | 4 | 32 | 27 | batched b32 | 29.728 | 1.0 | 0.6 | - |
| f32 | gate/up | 4 | 32 | 27 | rowwise | 21.755 | 1.3 | 0.8 | - |
| f32 | gate/up | 4 | 32 | 27 | experts b1 | 1.751 | 16.2 | 9.6 | 14.20 |
| f32 | gate/up | 8 | 64 | 41 | reference ragged_dot | 83.799 | 0.5 | 0.4 | - |
| f32 | gate/up | 8 | 64 | 41 | **loop b1** (chosen) | 3.274 | 13.1 | 10.2 | - |
| f32 | gate/up | 8 | 64 | 41 | loop b4 | 5.202 | 8.3 | 6.5 | - |
| f32 | gate/up | 8 | 64 | 41 | loop b8 | 5.691 | 7.6 | 5.9 | 1.44 |
| f32 | gate/up | 8 | 64 | 41 | loop b16 | 7.146 | 6.0 | 4.7 | 1.55 |
| f32 | gate/up | 8 | 64 | 41 | loop b32 | 9.713 | 4.4 | 3.5 | - |
| f32 | gate/up | 8 | 64 | 41 | loop b64 | 16.097 | 2.7 | 2.1 | - |
| f32 | gate/up | 8 | 64 | 41 | batched b8 | 111.942 | 0.4 | 0.3 | - |
| f32 | gate/up | 8 | 64 | 41 | batched b32 | 72.348 | 0.6 | 0.5 | - |
| f32 | gate/up | 8 | 64 | 41 | rowwise | 41.328 | 1.0 | 0.8 | - |
| f32 | gate/up | 8 | 64 | 41 | experts b1 | 2.788 | 15.4 | 12.0 | 10.78 |
| f32 | gate/up | 32 | 256 | 63 | loop b8 | 10.144 | 6.5 | 13.2 | 1.10 |
| f32 | gate/up | 32 | 256 | 63 | **loop b16** (chosen) | 16.065 | 4.1 | 8.4 | - |
| f32 | gate/up | 32 | 256 | 63 | loop b32 | 16.435 | 4.0 | 8.2 | - |
| f32 | gate/up | 32 | 256 | 63 | loop b64 | 23.045 | 2.9 | 5.8 | - |
| f32 | gate/up | 32 | 256 | 63 | rowwise | 177.714 | 0.4 | 0.8 | - |
| f32 | gate/up | 32 | 256 | 63 | experts b16 | 15.105 | 4.4 | 8.9 | 10.13 |
| f32 | gate/up | 64 | 512 | 64 | loop b8 | 14.650 | 4.6 | 18.3 | - |
| f32 | gate/up | 64 | 512 | 64 | **loop b16** (chosen) | 11.037 | 6.1 | 24.3 | 2.26 |
| f32 | gate/up | 64 | 512 | 64 | loop b32 | 15.307 | 4.4 | 17.5 | - |
| f32 | gate/up | 64 | 512 | 64 | loop b64 | 20.549 | 3.3 | 13.1 | - |
| f32 | gate/up | 64 | 512 | 64 | experts b16 | 19.794 | 3.4 | 13.6 | 12.10 |
| f32 | gate/up | 128 | 1024 | 64 | loop b8 | 22.637 | 3.0 | 23.7 | - |
| f32 | gate/up | 128 | 1024 | 64 | loop b16 | 17.660 | 3.8 | 30.4 | 1.04 |
| f32 | gate/up | 128 | 1024 | 64 | **loop b32** (chosen) | 14.753 | 4.5 | 36.4 | 0.94 |
| f32 | gate/up | 128 | 1024 | 64 | loop b64 | 23.708 | 2.8 | 22.6 | - |
| f32 | gate/up | 128 | 1024 | 64 | experts b16 | 22.138 | 3.0 | 24.3 | 24.52 |
| f32 | gate/up | 128 | 1024 | 64 | experts b32 | 17.422 | 3.9 | 30.8 | 12.61 |
| f32 | gate/up | 256 | 2048 | 64 | loop b8 | 36.606 | 1.8 | 29.3 | - |
| f32 | gate/up | 256 | 2048 | 64 | loop b16 | 27.127 | 2.5 | 39.6 | 3.22 |
| f32 | gate/up | 256 | 2048 | 64 | **loop b32** (chosen) | 16.723 | 4.0 | 64.2 | 1.41 |
| f32 | gate/up | 256 | 2048 | 64 | loop b64 | 23.992 | 2.8 | 44.8 | - |
| f32 | gate/up | 256 | 2048 | 64 | experts b16 | 25.231 | 2.7 | 42.6 | 13.22 |
| f32 | gate/up | 256 | 2048 | 64 | experts b32 | 20.930 | 3.2 | 51.3 | 21.85 |
| f32 | down | 1 | 8 | 8 | reference ragged_dot | 95.919 | 0.1 | 0.0 | - |
| f32 | down | 1 | 8 | 8 | loop b1 | 0.448 | 18.7 | 9.4 | 2.32 |
| f32 | down | 1 | 8 | 8 | loop b4 | 0.780 | 10.8 | 5.4 | - |
| f32 | down | 1 | 8 | 8 | loop b8 | 0.906 | 9.3 | 4.6 | - |
| f32 | down | 1 | 8 | 8 | batched b8 | 1.423 | 5.9 | 2.9 | - |
| f32 | down | 1 | 8 | 8 | **rowwise** (chosen) | 0.380 | 22.1 | 11.0 | - |
| f32 | down | 1 | 8 | 8 | experts b1 | 0.448 | 18.7 | 9.4 | 28.24 |
| f32 | down | 4 | 32 | 29 | reference ragged_dot | 123.981 | 0.2 | 0.1 | - |
| f32 | down | 4 | 32 | 29 | **loop b1** (chosen) | 1.846 | 16.5 | 9.1 | 0.89 |
| f32 | down | 4 | 32 | 29 | loop b4 | 3.314 | 9.2 | 5.1 | - |
| f32 | down | 4 | 32 | 29 | loop b8 | 3.127 | 9.7 | 5.4 | 0.91 |
| f32 | down | 4 | 32 | 29 | loop b16 | 3.732 | 8.1 | 4.5 | - |
| f32 | down | 4 | 32 | 29 | loop b32 | 6.397 | 4.8 | 2.6 | - |
| f32 | down | 4 | 32 | 29 | batched b8 | 22.537 | 1.3 | 0.7 | - |
| f32 | down | 4 | 32 | 29 | batched b32 | 25.567 | 1.2 | 0.7 | - |
| f32 | down | 4 | 32 | 29 | rowwise | 15.147 | 2.0 | 1.1 | - |
| f32 | down | 4 | 32 | 29 | experts b1 | 1.805 | 16.8 | 9.3 | 15.15 |
| f32 | down | 8 | 64 | 42 | reference ragged_dot | 78.909 | 0.6 | 0.4 | - |
| f32 | down | 8 | 64 | 42 | **loop b1** (chosen) | 3.364 | 13.1 | 10.0 | - |
| f32 | down | 8 | 64 | 42 | loop b4 | 5.819 | 7.6 | 5.8 | - |
| f32 | down | 8 | 64 | 42 | loop b8 | 5.794 | 7.6 | 5.8 | - |
| f32 | down | 8 | 64 | 42 | loop b16 | 5.005 | 8.8 | 6.7 | - |
| f32 | down | 8 | 64 | 42 | loop b32 | 8.726 | 5.0 | 3.8 | - |
| f32 | down | 8 | 64 | 42 | loop b64 | 14.096 | 3.1 | 2.4 | - |
| f32 | down | 8 | 64 | 42 | batched b8 | 67.292 | 0.7 | 0.5 | - |
| f32 | down | 8 | 64 | 42 | batched b32 | 88.772 | 0.5 | 0.4 | - |
| f32 | down | 8 | 64 | 42 | rowwise | 42.466 | 1.0 | 0.8 | - |
| f32 | down | 8 | 64 | 42 | experts b1 | 2.979 | 14.8 | 11.3 | 12.35 |
| f32 | down | 32 | 256 | 63 | loop b8 | 8.275 | 8.0 | 16.2 | - |
| f32 | down | 32 | 256 | 63 | **loop b16** (chosen) | 5.364 | 12.3 | 25.0 | 1.26 |
| f32 | down | 32 | 256 | 63 | loop b32 | 11.930 | 5.5 | 11.3 | 1.19 |
| f32 | down | 32 | 256 | 63 | loop b64 | 26.146 | 2.5 | 5.1 | - |
| f32 | down | 32 | 256 | 63 | rowwise | 200.733 | 0.3 | 0.7 | - |
| f32 | down | 32 | 256 | 63 | experts b16 | 9.282 | 7.1 | 14.5 | 8.80 |
| f32 | down | 64 | 512 | 64 | loop b8 | 12.253 | 5.5 | 21.9 | 1.59 |
| f32 | down | 64 | 512 | 64 | **loop b16** (chosen) | 10.074 | 6.7 | 26.6 | 1.34 |
| f32 | down | 64 | 512 | 64 | loop b32 | 11.127 | 6.0 | 24.1 | - |
| f32 | down | 64 | 512 | 64 | loop b64 | 18.625 | 3.6 | 14.4 | - |
| f32 | down | 64 | 512 | 64 | experts b16 | 12.147 | 5.5 | 22.1 | 8.90 |
| f32 | down | 128 | 1024 | 64 | loop b8 | 19.701 | 3.4 | 27.3 | - |
| f32 | down | 128 | 1024 | 64 | loop b16 | 14.672 | 4.6 | 36.6 | - |
| f32 | down | 128 | 1024 | 64 | **loop b32** (chosen) | 13.952 | 4.8 | 38.5 | - |
| f32 | down | 128 | 1024 | 64 | loop b64 | 18.785 | 3.6 | 28.6 | - |
| f32 | down | 128 | 1024 | 64 | experts b16 | 14.389 | 4.7 | 37.3 | 14.80 |
| f32 | down | 128 | 1024 | 64 | experts b32 | 13.238 | 5.1 | 40.6 | 7.73 |
| f32 | down | 256 | 2048 | 64 | loop b8 | 47.896 | 1.4 | 22.4 | - |
| f32 | down | 256 | 2048 | 64 | loop b16 | 21.157 | 3.2 | 50.8 | 1.10 |
| f32 | down | 256 | 2048 | 64 | **loop b32** (chosen) | 21.457 | 3.1 | 50.0 | 1.12 |
| f32 | down | 256 | 2048 | 64 | loop b64 | 20.880 | 3.2 | 51.4 | - |
| f32 | down | 256 | 2048 | 64 | experts b16 | 20.480 | 3.3 | 52.4 | 6.05 |
| f32 | down | 256 | 2048 | 64 | experts b32 | 11.029 | 6.1 | 97.4 | 3.91 |
| bf16 | gate/up | 1 | 8 | 8 | reference ragged_dot | 64.328 | 0.1 | 0.1 | 0.70 |
| bf16 | gate/up | 1 | 8 | 8 | loop b1 | 40.500 | 0.1 | 0.1 | - |
| bf16 | gate/up | 1 | 8 | 8 | loop b1 noupcast | 36.389 | 0.1 | 0.1 | - |
| bf16 | gate/up | 1 | 8 | 8 | loop b4 | 48.941 | 0.1 | 0.1 | - |
| bf16 | gate/up | 1 | 8 | 8 | loop b4 noupcast | 35.860 | 0.1 | 0.1 | - |
| bf16 | gate/up | 1 | 8 | 8 | loop b8 | 36.409 | 0.1 | 0.1 | - |
| bf16 | gate/up | 1 | 8 | 8 | loop b8 noupcast | 37.729 | 0.1 | 0.1 | - |
| bf16 | gate/up | 1 | 8 | 8 | batched b8 | 0.786 | 5.3 | 5.3 | 0.83 |
| bf16 | gate/up | 1 | 8 | 8 | **rowwise** (chosen) | 0.309 | 13.6 | 13.6 | 0.41 |
| bf16 | gate/up | 1 | 8 | 8 | experts b1 | 0.510 | 8.2 | 8.2 | 4.02 |
| bf16 | gate/up | 4 | 32 | 29 | reference ragged_dot | 43.339 | 0.4 | 0.4 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b1 | 34.156 | 0.4 | 0.5 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b1 noupcast | 38.233 | 0.4 | 0.4 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b4 | 43.152 | 0.4 | 0.4 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b4 noupcast | 79.117 | 0.2 | 0.2 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b8 | 50.998 | 0.3 | 0.3 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b8 noupcast | 50.068 | 0.3 | 0.3 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b16 | 49.737 | 0.3 | 0.3 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b16 noupcast | 70.200 | 0.2 | 0.2 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b32 | 59.431 | 0.3 | 0.3 | - |
| bf16 | gate/up | 4 | 32 | 29 | loop b32 noupcast | 37.199 | 0.4 | 0.5 | - |
| bf16 | gate/up | 4 | 32 | 29 | batched b8 | 36.132 | 0.4 | 0.5 | - |
| bf16 | gate/up | 4 | 32 | 29 | batched b32 | 47.193 | 0.3 | 0.4 | - |
| bf16 | gate/up | 4 | 32 | 29 | rowwise | 36.917 | 0.4 | 0.5 | - |
| bf16 | gate/up | 4 | 32 | 29 | **experts b1** (chosen) | 1.348 | 11.3 | 12.4 | 17.16 |
| bf16 | gate/up | 8 | 64 | 40 | reference ragged_dot | 171.781 | 0.1 | 0.2 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b1 | 79.601 | 0.3 | 0.4 | 1.51 |
| bf16 | gate/up | 8 | 64 | 40 | loop b1 noupcast | 83.983 | 0.2 | 0.4 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b4 | 71.740 | 0.3 | 0.5 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b4 noupcast | 67.750 | 0.3 | 0.5 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b8 | 88.059 | 0.2 | 0.4 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b8 noupcast | 52.850 | 0.4 | 0.6 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b16 | 65.606 | 0.3 | 0.5 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b16 noupcast | 67.993 | 0.3 | 0.5 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b32 | 72.826 | 0.3 | 0.5 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b32 noupcast | 53.278 | 0.4 | 0.6 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b64 | 94.002 | 0.2 | 0.4 | - |
| bf16 | gate/up | 8 | 64 | 40 | loop b64 noupcast | 71.997 | 0.3 | 0.5 | - |
| bf16 | gate/up | 8 | 64 | 40 | batched b8 | 88.092 | 0.2 | 0.4 | - |
| bf16 | gate/up | 8 | 64 | 40 | batched b32 | 76.093 | 0.3 | 0.4 | - |
| bf16 | gate/up | 8 | 64 | 40 | rowwise | 47.664 | 0.4 | 0.7 | - |
| bf16 | gate/up | 8 | 64 | 40 | **experts b1** (chosen) | 2.820 | 7.4 | 11.9 | 13.42 |
| bf16 | gate/up | 32 | 256 | 64 | loop b8 | 62.704 | 0.5 | 2.1 | - |
| bf16 | gate/up | 32 | 256 | 64 | loop b8 noupcast | 42.633 | 0.8 | 3.1 | - |
| bf16 | gate/up | 32 | 256 | 64 | loop b16 | 61.575 | 0.5 | 2.2 | 1.71 |
| bf16 | gate/up | 32 | 256 | 64 | loop b16 noupcast | 76.533 | 0.4 | 1.8 | - |
| bf16 | gate/up | 32 | 256 | 64 | loop b32 | 79.954 | 0.4 | 1.7 | 1.52 |
| bf16 | gate/up | 32 | 256 | 64 | loop b32 noupcast | 112.899 | 0.3 | 1.2 | - |
| bf16 | gate/up | 32 | 256 | 64 | loop b64 | 123.129 | 0.3 | 1.1 | - |
| bf16 | gate/up | 32 | 256 | 64 | loop b64 noupcast | 105.803 | 0.3 | 1.3 | - |
| bf16 | gate/up | 32 | 256 | 64 | rowwise | 260.529 | 0.1 | 0.5 | - |
| bf16 | gate/up | 32 | 256 | 64 | **experts b16** (chosen) | 9.389 | 3.6 | 14.3 | 3.52 |
| bf16 | gate/up | 64 | 512 | 64 | loop b8 | 71.608 | 0.5 | 3.7 | - |
| bf16 | gate/up | 64 | 512 | 64 | loop b8 noupcast | 69.738 | 0.5 | 3.8 | - |
| bf16 | gate/up | 64 | 512 | 64 | loop b16 | 59.223 | 0.6 | 4.5 | - |
| bf16 | gate/up | 64 | 512 | 64 | loop b16 noupcast | 52.216 | 0.6 | 5.1 | - |
| bf16 | gate/up | 64 | 512 | 64 | loop b32 | 91.994 | 0.4 | 2.9 | 1.16 |
| bf16 | gate/up | 64 | 512 | 64 | **experts b16** (chosen) | 9.974 | 3.4 | 26.9 | 3.02 |
| bf16 | gate/up | 128 | 1024 | 64 | loop b16 | 86.866 | 0.4 | 6.2 | 1.73 |
| bf16 | gate/up | 128 | 1024 | 64 | loop b32 | 84.999 | 0.4 | 6.3 | 1.06 |
| bf16 | gate/up | 128 | 1024 | 64 | experts b16 | 28.775 | 1.2 | 18.7 | 9.36 |
| bf16 | gate/up | 128 | 1024 | 64 | **experts b32** (chosen) | 26.965 | 1.2 | 19.9 | 10.01 |
| bf16 | gate/up | 256 | 2048 | 64 | loop b16 | 100.678 | 0.3 | 10.7 | 0.90 |
| bf16 | gate/up | 256 | 2048 | 64 | loop b32 | 117.641 | 0.3 | 9.1 | 1.63 |
| bf16 | gate/up | 256 | 2048 | 64 | experts b16 | 46.072 | 0.7 | 23.3 | 10.34 |
| bf16 | gate/up | 256 | 2048 | 64 | **experts b32** (chosen) | 45.087 | 0.7 | 23.8 | 12.12 |
| bf16 | down | 1 | 8 | 8 | reference ragged_dot | 79.947 | 0.1 | 0.1 | 0.59 |
| bf16 | down | 1 | 8 | 8 | loop b1 | 70.028 | 0.1 | 0.1 | 1.40 |
| bf16 | down | 1 | 8 | 8 | experts b1 | 0.476 | 8.8 | 8.8 | 3.41 |
| bf16 | down | 1 | 8 | 8 | batched b8 | 0.993 | 4.2 | 4.2 | 1.01 |
| bf16 | down | 1 | 8 | 8 | **rowwise** (chosen) | 0.356 | 11.8 | 11.8 | 0.67 |
| bf16 | down | 4 | 32 | 26 | loop b1 | 39.791 | 0.3 | 0.4 | 1.02 |
| bf16 | down | 4 | 32 | 26 | **experts b1** (chosen) | 1.244 | 11.0 | 13.5 | 4.87 |
| bf16 | down | 8 | 64 | 43 | loop b1 | 90.299 | 0.2 | 0.4 | 1.20 |
| bf16 | down | 8 | 64 | 43 | loop b16 | 69.456 | 0.3 | 0.5 | 1.31 |
| bf16 | down | 8 | 64 | 43 | **experts b1** (chosen) | 2.611 | 8.6 | 12.9 | 3.96 |
| bf16 | down | 32 | 256 | 63 | loop b16 | 68.604 | 0.5 | 2.0 | 1.21 |
| bf16 | down | 32 | 256 | 63 | loop b32 | 76.659 | 0.4 | 1.8 | 1.32 |
| bf16 | down | 32 | 256 | 63 | **experts b16** (chosen) | 10.950 | 3.0 | 12.3 | 3.61 |
| bf16 | down | 64 | 512 | 64 | loop b16 | 63.974 | 0.5 | 4.2 | 1.34 |
| bf16 | down | 64 | 512 | 64 | loop b32 | 57.890 | 0.6 | 4.6 | 1.78 |
| bf16 | down | 64 | 512 | 64 | **experts b16** (chosen) | 12.223 | 2.7 | 22.0 | 3.79 |
| bf16 | down | 128 | 1024 | 64 | loop b16 | 109.156 | 0.3 | 4.9 | 1.35 |
| bf16 | down | 128 | 1024 | 64 | loop b32 | 94.007 | 0.4 | 5.7 | 1.51 |
| bf16 | down | 128 | 1024 | 64 | experts b16 | 11.168 | 3.0 | 48.1 | 2.86 |
| bf16 | down | 128 | 1024 | 64 | **experts b32** (chosen) | 21.654 | 1.5 | 24.8 | 4.38 |
| bf16 | down | 256 | 2048 | 64 | loop b16 | 78.669 | 0.4 | 13.6 | 1.50 |
| bf16 | down | 256 | 2048 | 64 | loop b32 | 101.439 | 0.3 | 10.6 | 1.94 |
| bf16 | down | 256 | 2048 | 64 | experts b16 | 43.562 | 0.8 | 24.6 | 4.15 |
| bf16 | down | 256 | 2048 | 64 | **experts b32** (chosen) | 35.838 | 0.9 | 30.0 | 4.82 |
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def grouped_matmul_reference(rows, w, group_sizes):
    """The op's reference rule (qcompile/ir/ops/moe.py): ragged_dot with f32 accumulation, cast to rows.dtype."""
    out = jax.lax.ragged_dot(rows, jnp.swapaxes(w, 1, 2), group_sizes, precision=HIGHEST,
                             preferred_element_type=jnp.float32)
    return out.astype(rows.dtype)


# ----------------------------------------------------------------------------------------------------------------
# block table


def max_blocks(num_rows: int, num_experts: int, block: int) -> int:
    """Static upper bound on Σ_e ceil(g_e / block) for Σ g_e ≤ num_rows: each non-empty group wastes < 1 block."""
    if num_rows == 0:
        return 0
    return -(-num_rows // block) + min(num_experts, num_rows) - 1


def _group_offsets(group_sizes, num_rows):
    """Clipped group sizes (so that Σ ≤ N), exclusive starts and the number of real rows."""
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return ends - starts, starts, ends[-1]


def _block_table(group_sizes, num_rows: int, block: int, nb: int):
    """Per block j < nb: (expert, first row); plus the number of used blocks and each expert's first block."""
    gs, starts, total = _group_offsets(group_sizes, num_rows)
    nblk = (gs + block - 1) // block
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    used = blk_end[-1]
    j = jnp.arange(nb, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(blk_end, j, side="right"), gs.shape[0] - 1).astype(jnp.int32)
    first_row = starts[expert] + (j - blk_start[expert]) * block
    return expert, first_row, used, blk_start, starts, total


def _zero_padding(out, total):
    valid = jnp.arange(out.shape[0], dtype=jnp.int32) < total
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


def _dot_t(x, wt, upcast: bool):
    """x[..., K] · wt[Nout, K]ᵀ in f32."""
    if upcast:
        x = x.astype(jnp.float32)
        wt = wt.astype(jnp.float32)
    return jax.lax.dot_general(x, wt, (((x.ndim - 1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# strategies


def grouped_matmul_blocks_loop(rows, w, group_sizes, *, block: int = 16, upcast: bool | None = None):
    """While-loop over the used row blocks; each block = dynamic_slice(rows) · w[e]ᵀ (see module docstring).

    upcast: convert each block's operands to f32 before the dot (default: when rows are not f32; XLA's CPU bf16 dot
    is far slower than the f32 one for skinny products).
    """
    n, k = rows.shape
    e, nout, _ = w.shape
    if upcast is None:
        upcast = rows.dtype != jnp.float32
    if n == 0:
        return jnp.zeros((0, nout), rows.dtype)
    block = max(1, min(block, n))
    nb = max_blocks(n, e, block)
    expert, first_row, used, _, _, total = _block_table(group_sizes, n, block, nb)
    padded = jnp.concatenate([rows, jnp.zeros((block, k), rows.dtype)], axis=0)  # no slice ever clamps
    out = jnp.zeros((n + block, nout), rows.dtype)

    def body(carry):
        j, out = carry
        r0 = first_row[j]
        x = jax.lax.dynamic_slice_in_dim(padded, r0, block, axis=0)
        wt = jax.lax.dynamic_index_in_dim(w, expert[j], axis=0, keepdims=False)
        y = _dot_t(x, wt, upcast).astype(rows.dtype)
        return j + 1, jax.lax.dynamic_update_slice_in_dim(out, y, r0, axis=0)

    _, out = jax.lax.while_loop(lambda c: c[0] < used, body, (jnp.int32(0), out))
    return _zero_padding(out[:n], total)


def grouped_matmul_blocks_batched(rows, w, group_sizes, *, block: int = 16, upcast: bool | None = None):
    """All blocks in one batched einsum against per-block gathered weights (see module docstring)."""
    n, k = rows.shape
    e, nout, _ = w.shape
    if upcast is None:
        upcast = rows.dtype != jnp.float32
    if n == 0:
        return jnp.zeros((0, nout), rows.dtype)
    block = max(1, min(block, n))
    nb = max_blocks(n, e, block)
    expert, first_row, _, blk_start, starts, total = _block_table(group_sizes, n, block, nb)
    idx = jnp.minimum(first_row[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :], n - 1)
    x = jnp.take(rows, idx, axis=0)  # [nb, block, K]
    wb = jnp.take(w, expert, axis=0)  # [nb, Nout, K]
    if upcast:
        x, wb = x.astype(jnp.float32), wb.astype(jnp.float32)
    y = jnp.einsum("bik,bok->bio", x, wb, precision=HIGHEST, preferred_element_type=jnp.float32)
    r = jnp.arange(n, dtype=jnp.int32)
    ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
    row_expert = jnp.minimum(jnp.searchsorted(ends, r, side="right"), e - 1)
    p = r - starts[row_expert]
    flat = (blk_start[row_expert] + p // block) * block + p % block
    flat = jnp.clip(flat, 0, nb * block - 1)
    out = jnp.take(y.reshape(nb * block, nout), flat, axis=0).astype(rows.dtype)
    return _zero_padding(out, total)


def grouped_matmul_experts_unrolled(rows, w, group_sizes, *, block: int = 8, upcast: bool | None = None):
    """A static Python loop over the E experts; expert e runs under `lax.cond(g_e > 0)` a while-loop over its
    ceil(g_e/block) row blocks, each dynamic_slice(rows) · w[e]ᵀ written back with dynamic_update_slice.

    The weight slice w[e] has a static index, so XLA does not copy it per block as it does for a dynamic index
    (see `grouped_matmul_blocks_loop`); experts with no rows cost one predicate. Rows of a block past its group's end
    are overwritten by later experts (experts run in row order) or zeroed at the end as padding. The graph holds E
    conditionals (compile time grows with E).
    """
    n, k = rows.shape
    e, nout, _ = w.shape
    if upcast is None:
        upcast = rows.dtype != jnp.float32
    if n == 0:
        return jnp.zeros((0, nout), rows.dtype)
    block = max(1, min(block, n))
    gs, starts, total = _group_offsets(group_sizes, n)
    nblk = (gs + block - 1) // block
    padded = jnp.concatenate([rows, jnp.zeros((block, k), rows.dtype)], axis=0)
    out = jnp.zeros((n + block, nout), rows.dtype)
    for ex in range(e):
        def expert(out, ex=ex):
            wt = w[ex]
            if upcast:
                wt = wt.astype(jnp.float32)

            def body(carry):
                i, out = carry
                r0 = starts[ex] + i * block
                x = jax.lax.dynamic_slice_in_dim(padded, r0, block, axis=0)
                y = _dot_t(x.astype(wt.dtype), wt, False).astype(rows.dtype)
                return i + 1, jax.lax.dynamic_update_slice_in_dim(out, y, r0, axis=0)

            return jax.lax.while_loop(lambda c: c[0] < nblk[ex], body, (jnp.int32(0), out))[1]

        out = jax.lax.cond(nblk[ex] > 0, expert, lambda o: o, out)
    return _zero_padding(out[:n], total)


def grouped_matmul_rowwise(rows, w, group_sizes, *, upcast: bool | None = None):
    """Each row times its own expert's weight: gather w per row, batched matvec. Decode sizes only."""
    n, k = rows.shape
    e, nout, _ = w.shape
    if upcast is None:
        upcast = rows.dtype != jnp.float32
    _, _, total = _group_offsets(group_sizes, n)
    ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
    row_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n, dtype=jnp.int32), side="right"), e - 1)
    wr = jnp.take(w, row_expert, axis=0)  # [N, Nout, K]
    x = rows
    if upcast:
        x, wr = x.astype(jnp.float32), wr.astype(jnp.float32)
    y = jnp.einsum("nk,nok->no", x, wr, precision=HIGHEST, preferred_element_type=jnp.float32)
    return _zero_padding(y.astype(rows.dtype), total)


# ----------------------------------------------------------------------------------------------------------------
# the CPU rule


def choose_strategy(num_rows: int, num_experts: int, k: int, nout: int, dtype) -> str:
    """The strategy name for a static shape, as benchmarks/grouped_matmul_cpu.py names them: "rowwise",
    "loop b<block>" (grouped_matmul_blocks_loop), "experts b<block>" (grouped_matmul_experts_unrolled).

    From the table in docs/cpu_rules.md (E=64, K/Nout = 1024/256 and 256/1024, top-8; min over 2-3 noisy runs; both
    matrices gave the same ordering):
    - N ≤ 8 rows (one decode token): "rowwise" (per-row weight gather + batched matvec): f32 0.38-0.52 ms vs 0.45-0.64
      for "loop b1" and 80-96 ms for ragged_dot; bf16 0.31-0.36 ms (best of all, 0.4 s compile). It falls off a
      cliff from N=32 on (15-40 ms), so only here.
    - f32, N ≤ 64: "loop b1" (one row per block = XNNPACK matvecs at 13-19 GB/s of weights; 8-row blocks read at
      ~6-9 GB/s): 1.7-1.8 ms at N=32, 3.3 ms at N=64 vs 79-124 ms for ragged_dot.
    - f32, N > 64: "loop b16" up to N=512 (5.4-16 ms at N=256-512), "loop b32" above (14-21 ms at N=1024-2048).
      "experts" (no per-block weight copy) is at best ~1.2x faster at N=2048 but costs 4-30 s of XLA compile per
      call site at E=64 (E unrolled conditionals), so it is not the f32 default.
    - bf16, N > 8: "experts" (block 1 up to N=64, 16 up to 512, 32 above): the block loop's dynamic slice of a bf16
      weight runs at 0.1-0.5 GB/s (35-120 ms per call at every N), "experts" (static weight slices) 1.2-2.8 ms at
      N=32-64 and 9.4-45 ms at N=256-2048 — and pays 4-17 s compile per call site.
    """
    del num_experts, k, nout
    if num_rows <= 8:
        return "rowwise"
    if jnp.dtype(dtype) == jnp.float32:
        if num_rows <= 64:
            return "loop b1"
        return "loop b16" if num_rows <= 512 else "loop b32"
    if num_rows <= 64:
        return "experts b1"
    return "experts b16" if num_rows <= 512 else "experts b32"


def grouped_matmul_cpu(rows, w, group_sizes):
    """The CPU lowering of grouped_matmul: the strategy `choose_strategy` picks for this static shape."""
    name = choose_strategy(rows.shape[0], w.shape[0], rows.shape[1], w.shape[1], rows.dtype)
    if name == "rowwise":
        return grouped_matmul_rowwise(rows, w, group_sizes)
    kind, block = name.split(" b")
    fn = grouped_matmul_blocks_loop if kind == "loop" else grouped_matmul_experts_unrolled
    return fn(rows, w, group_sizes, block=int(block))
