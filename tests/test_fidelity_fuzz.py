"""Random-config fidelity: random tiny models of both families, built by transformers and saved in random Hub layouts.

Each example (strategies.hf_cases) is a config transformers builds and saves, optionally re-packaged like the Hub
(shards, index, dummy mtp.* tensors, legacy config keys), and a prompt of 1–130 tokens (across the GDN chunk of 64
and the engine's token buckets). qcompile's prompt logits must be within the fp32 bound of transformers' (1e-4 of the
largest logit, as in test_fidelity), and its greedy tokens and their logits must be transformers'. Where the fp32
results disagree, a genuine float64 forward decides (hf_oracle's float64: experts_implementation="eager" and
transformers' internal float32 casts removed): qcompile passes when it is within the bound of float64, or no further
from float64 than 1.5x transformers' own fp32 (a model that amplifies rounding beyond the bound); a greedy token may
differ only where float64's top-2 margin is within twice the bound (a tie fp32 cannot resolve), and nothing is
compared after such a tie.

The oracle is the class that wrote the checkpoint (config.json's `architectures`), so tied Qwen3.5 wrappers are
judged by the class that ties them. Configs transformers itself cannot run are filtered out (Hypothesis `assume`),
never counted as passes.

Example counts: QCOMPILE_FUZZ_EXAMPLES (default 3 in the default suite); the slow tier runs
QCOMPILE_FUZZ_SLOW_EXAMPLES (default 200). Hypothesis prints the failing case, its seed and a reproduction blob.
QCOMPILE_FUZZ_LOG=FILE appends one JSON line per example (case and result) for the record in docs/fidelity.md.
"""

from __future__ import annotations

import gc
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, note, settings

import hf_oracle
from strategies import hf_cases, transformers_cannot_run
from qcompile.ir.abi import CacheConfig
from qcompile.runtime.model import load_model

REL_BOUND = 1e-4
DECODE_STEPS = 4
DEFAULT_EXAMPLES = int(os.environ.get("QCOMPILE_FUZZ_EXAMPLES", "3"))
SLOW_EXAMPLES = int(os.environ.get("QCOMPILE_FUZZ_SLOW_EXAMPLES", "200"))
SUPPRESS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large,
            HealthCheck.filter_too_much]


def write_case(case: dict, root) -> "os.PathLike":
    """The case's checkpoint: saved by transformers, then re-packaged Hub-style when it asks for shards."""
    made = hf_oracle.make_hf_checkpoint(root / "saved", case["family"], seed=case["seed"],
                                        overrides=case["overrides"], stacked_experts=case["stacked_experts"],
                                        wrapper_tie=case["wrapper_tie"])
    if case["shards"] == 1:
        return made
    return hf_oracle.reshard_hub_style(made, root / "hub", n_shards=case["shards"], legacy_config=case["legacy_config"])


def within_float64(ours, fp32, f64, bound: float, what: str) -> tuple[float, float]:
    """Where fp32 results disagree: ours must be within the bound of float64, or at least about as close to it as
    transformers' own fp32 (1.5x: issue 11's criterion) on a model that amplifies rounding beyond the bound."""
    ours64, hf64 = float(np.abs(ours - f64).max()), float(np.abs(fp32 - f64).max())
    assert ours64 <= max(bound, 1.5 * hf64), (
        f"{what}: {float(np.abs(ours - fp32).max()):.3g} from transformers fp32 (bound {bound:.3g}) and {ours64:.3g} "
        f"from float64, where transformers fp32 is {hf64:.3g} from it")
    return ours64, hf64


def check_case(case: dict, root) -> dict:
    """Compare one case with transformers; returns what was compared (for the caller's note and the fuzz log)."""
    path = write_case(case, root)
    vocab = case["overrides"]["vocab_size"]
    prompt = [int(x) for x in np.random.default_rng(case["seed"]).integers(3, vocab, case["prompt_len"])]
    model = load_model(path, progress=False)
    engine = model.engine(CacheConfig(max_seqs=2, max_context=256))
    out = engine.generate([prompt], DECODE_STEPS, prompt_logits=True, step_logits=True)
    ours_prompt, ours_tokens, ours_steps = out["prompt_logits"][0], out["tokens"][0], out["step_logits"][0]

    ref = hf_oracle.hf_logits(path, prompt, by_architecture=True)
    bound = REL_BOUND * max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(ours_prompt - ref).max())
    report = {"prompt_err": err, "bound": bound, "judged_by_f64": [], "tie_at": None}
    if err > bound:  # in doubt: a genuine float64 forward decides whose fp32 error this is
        f64 = hf_oracle.hf_logits(path, prompt, dtype="float64", by_architecture=True)
        report["judged_by_f64"].append(("prompt", *within_float64(ours_prompt, ref, f64, bound, "prompt logits")))

    ref_tokens, ref_steps = hf_oracle.hf_greedy(path, prompt, DECODE_STEPS, by_architecture=True)
    f64_tokens = f64_steps = None
    for i, (mine, theirs) in enumerate(zip(ours_tokens, ref_tokens)):
        step_err = float(np.abs(ours_steps[i] - ref_steps[i]).max())
        if mine == theirs and step_err <= bound:
            continue
        if f64_steps is None:
            f64_tokens, f64_steps = hf_oracle.hf_greedy(path, prompt, DECODE_STEPS, dtype="float64",
                                                        by_architecture=True)
        if f64_tokens[:i] != ours_tokens[:i]:
            break  # float64 took another path earlier (a tie both fp32 runs resolved alike): nothing comparable left
        if mine == theirs:
            report["judged_by_f64"].append(
                (f"step {i}", *within_float64(ours_steps[i], ref_steps[i], f64_steps[i], bound, f"decode step {i}")))
            continue
        top2 = np.sort(np.asarray(f64_steps[i], np.float64))[-2:]
        margin = float(top2[1] - top2[0])
        assert margin <= 2 * bound, (f"greedy token {i}: ours {mine}, transformers {theirs}, float64 {f64_tokens[i]}, "
                                     f"whose top-2 margin {margin:.3g} is no tie (bound {bound:.3g})")
        report["tie_at"] = i
        break  # after a tie the two continue from different tokens: nothing left to compare
    del model, engine
    return report


def run_case(case: dict, tmp_path_factory) -> None:
    why_not = transformers_cannot_run(case)
    note(f"case: {case}")
    assume(why_not is None)
    root = tmp_path_factory.mktemp("fuzz")
    result = {"error": "failed"}
    try:
        result = check_case(case, root)
        note(f"result: {result}")
    finally:
        if os.environ.get("QCOMPILE_FUZZ_LOG"):
            with open(os.environ["QCOMPILE_FUZZ_LOG"], "a") as log:
                log.write(json.dumps({"case": case, "result": result}) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        hf_oracle.clear_cache()
        import jax

        jax.clear_caches()  # every example compiles new shapes: keep the process's executable mappings bounded
        gc.collect()


@settings(max_examples=DEFAULT_EXAMPLES, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=SUPPRESS)
@given(case=hf_cases())
def test_random_configs_and_layouts_match_transformers(case, tmp_path_factory):
    run_case(case, tmp_path_factory)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, print_blob=True, suppress_health_check=SUPPRESS)
@given(case=hf_cases())
def test_many_random_configs_and_layouts_match_transformers(case, tmp_path_factory):
    run_case(case, tmp_path_factory)
