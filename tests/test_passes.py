"""The pass machinery: SPEC parsing, the manager's audits, verification, numerics checks, instruments, reproducers.

Exercised with the passes in toy_passes.py (real rewrites; some broken on purpose).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import toy_passes
from qcompile.errors import NumericsError, UsageError, VerificationError
from qcompile.passes.base import REASSOCIATING, PassContext
from qcompile.passes.equivalence import EquivalenceChecker, compare, structural_hash
from qcompile.passes.manager import Instruments, PassError, Reproducer, run_pipeline
from qcompile.passes.registry import parse_spec

TABLE = {**toy_passes.GOOD, **toy_passes.BROKEN}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import write_small
    from qcompile.runtime.model import load_model

    path = write_small(tmp_path_factory.mktemp("passes") / "m", family="qwen3_5_moe", seed=4)
    model = load_model(path, progress=False, layout=False)  # passes see the checkpoint's layout
    return model, EquivalenceChecker(model.graph, model.params, seed=0)


def names(passes):
    return [p.name for p in passes]


def test_spec_syntax():
    good = toy_passes.GOOD
    assert names(parse_spec("all", good)) == ["swap-add", "split-linear", "needs-devices"]
    assert names(parse_spec("none", good)) == []
    assert names(parse_spec("split-linear,swap-add", good)) == ["swap-add", "split-linear"]  # table order
    assert names(parse_spec("all,-swap-add", good)) == ["split-linear", "needs-devices"]
    assert names(parse_spec("swap-add,-swap-add,swap-add", good)) == ["swap-add"]  # last mention wins
    assert names(parse_spec("all,none,needs-devices", good)) == ["needs-devices"]
    with pytest.raises(UsageError, match="valid names: swap-add, split-linear, needs-devices"):
        parse_spec("all,-nope", good)


def test_good_pipeline_reports_every_pass(tiny):
    model, checker = tiny
    passes = parse_spec("all", toy_passes.GOOD)
    result = run_pipeline(model.graph, passes, PassContext(num_devices=1), checker=checker)
    swap, split, skip = result.records
    assert swap.status == "applied" and swap.changed and swap.stats["swapped"] >= 5
    assert swap.check["max_error"] == 0.0 and swap.check["bound"] == 0.0  # exact class: bitwise
    assert split.status == "applied" and split.stats["split"] >= 5 and split.check["max_error"] <= 1e-5
    assert skip.status == "skipped" and skip.reason == "needs 2+ devices, have 1" and skip.check is None
    assert skip.note == "cost structure only on cpu"  # a skipped pass's record carries its cpu note too
    assert result.final_check.ok and result.final_check.max_error <= 1e-5
    assert set(result.final_check.errors) == set(model.graph.outputs)  # logits and every cache compared
    assert "skipped   needs 2+ devices" in skip.line() and "max error" in split.line()


@pytest.mark.parametrize("pass_name", ["swap-add", "split-linear"])
def test_passes_are_idempotent_and_pure(tiny, pass_name):
    model, _ = tiny
    p = toy_passes.GOOD[pass_name]
    before = structural_hash(model.graph)
    once = p.run(model.graph, PassContext()).graph
    assert structural_hash(model.graph) == before
    twice = p.run(once, PassContext())
    assert not twice.changed and twice.graph is once  # running twice equals running once


def test_numerics_failure_names_the_pass_and_writes_a_reproducer(tiny, tmp_path):
    model, checker = tiny
    passes = [toy_passes.SWAP_ADD, toy_passes.LOOSEN_EPS]
    repro = Reproducer(tmp_path / "repro", checkpoint="CKPT", settings={"dtype": "f32"})
    seen = []
    with pytest.raises(NumericsError) as err:
        run_pipeline(model.graph, passes, checker=checker, reproducer=repro, on_record=seen.append)
    text = str(err.value)
    assert "after pass loosen-eps (after: swap-add)" in text and "relative error" in text and err.value.exit_code == 3
    assert [r.status for r in seen] == ["applied", "failed"]
    (path,) = list((tmp_path / "repro").iterdir())
    info = json.loads((path / "repro.json").read_text())
    assert info["failing_pass"] == "loosen-eps" and info["passes_before"] == ["swap-add"]
    assert info["max_error"] > info["bound"] == 1e-5 and info["seed"] == 0 and info["checkpoint"] == "CKPT"
    assert (path / "input.qir").read_text().startswith("graph @") and (path / "pipeline.txt").read_text() == "loosen-eps\n"


def test_verifier_failure_is_exit_4_and_names_the_pass(tiny):
    model, checker = tiny
    with pytest.raises(VerificationError, match=r"after pass wrong-types \(after: swap-add\)") as err:
        run_pipeline(model.graph, [toy_passes.SWAP_ADD, toy_passes.WRONG_TYPES], checker=checker, verify_mode="none")
    assert err.value.exit_code == 4


def test_changed_flag_is_audited(tiny):
    model, _ = tiny
    with pytest.raises(VerificationError, match="liar reported no change but the graph is different"):
        run_pipeline(model.graph, [toy_passes.LIAR], verify_mode="none")


def test_a_crashing_pass_is_named(tiny):
    model, _ = tiny
    with pytest.raises(PassError, match=r"pass crash raised RuntimeError: boom \(after: swap-add\)"):
        run_pipeline(model.graph, [toy_passes.SWAP_ADD, toy_passes.CRASH], verify_mode="none")


def test_final_mode_checks_only_the_end(tiny):
    model, checker = tiny
    result = run_pipeline(model.graph, [toy_passes.SWAP_ADD, toy_passes.SPLIT_LINEAR], checker=checker,
                          verify_mode="final")
    assert all(r.check is None for r in result.records) and result.final_check.ok
    with pytest.raises(NumericsError, match="optimized graph against the unoptimized one failed"):
        run_pipeline(model.graph, [toy_passes.LOOSEN_EPS], checker=checker, verify_mode="final")
    none = run_pipeline(model.graph, [toy_passes.SWAP_ADD], verify_mode="none")
    assert none.final_check is None and none.records[0].check is None


def test_instruments_dump_and_print(tiny, tmp_path):
    model, _ = tiny
    printed = []
    inst = Instruments(print_after=("swap-add",), dump_dir=tmp_path / "dump", emit=printed.append)
    run_pipeline(model.graph, parse_spec("all", toy_passes.GOOD), verify_mode="none", instruments=inst)
    files = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert files == ["000_input.qir", "001_swap-add.qir", "002_split-linear.qir", "003_needs-devices.qir"]
    assert len(printed) == 1 and printed[0].startswith("// ----- IR after swap-add -----")
    assert (tmp_path / "dump" / "002_split-linear.qir").read_text().count("concat(") >= 5
    changed = []
    run_pipeline(model.graph, parse_spec("all", toy_passes.GOOD), verify_mode="none",
                 instruments=Instruments(print_after_change=True, emit=changed.append))
    assert len(changed) == 2  # the skipped pass changed nothing


def test_compare_refuses_vacuous_and_non_finite_results():
    ref = {"logits": np.ones((2, 3), np.float32), "cache": np.zeros((4,), np.float32)}
    result = compare(ref, {"logits": np.ones((2, 3), np.float32), "cache": np.zeros((4,), np.float32)}, 1e-5)
    assert not result.ok and "all zeros" in result.reason
    ref = {"logits": np.ones((2, 3), np.float32)}
    bad = {"logits": np.array([[1, np.nan, 1], [1, 1, np.inf]], np.float32)}
    result = compare(ref, bad, 1.0)
    assert not result.ok and "2 NaN/inf" in result.reason
    shape = compare(ref, {"logits": np.ones((3, 2), np.float32)}, 1.0)
    assert not shape.ok and "changed from" in shape.reason
    close = compare(ref, {"logits": np.full((2, 3), 1.000001, np.float32)}, 1e-5)
    assert close.ok and 0 < close.max_error < 1e-5


def test_compare_checks_token_ids_as_tokens_forgiving_only_near_ties():
    logits = np.array([[5.0, 1.0, 0.0], [2.0, 2.0 - 1e-7, 0.0], [0.0, 1.0, 3.0]], np.float32)
    ref = {"logits": logits, "next_tokens": np.array([0, 0, 2], np.int32)}
    # Row 1 is a near-tie (tokens 0 and 1 within 1e-7 of each other), so flipping it passes.
    tie = compare(ref, {"logits": logits, "next_tokens": np.array([0, 1, 2], np.int32)}, 1e-5)
    assert tie.ok and tie.errors["next_tokens"] == 0.0 and tie.max_error == 0.0
    # Token 1 instead of 0 in row 0 is numerically "close" (ids 0 and 1) but is a different token: it fails.
    near_id = compare(ref, {"logits": logits, "next_tokens": np.array([1, 0, 2], np.int32)}, 1e-5)
    assert not near_id.ok and "1 of 3 token ids differ" in near_id.reason
    assert near_id.errors["next_tokens"] == 1 / 3
    # An out-of-range id is a difference, never an index error.
    wild = compare(ref, {"logits": logits, "next_tokens": np.array([0, 0, 99], np.int32)}, 1e-5)
    assert not wild.ok


def test_check_inputs_mix_prefill_decode_and_non_empty_caches(tiny):
    _, checker = tiny
    qs = checker.batch["query_start"]
    lengths = np.diff(qs)
    assert list(lengths[:3]) == [1, 5, 9]  # decode, continuation, fresh prefill
    positions = checker.batch["positions"]
    assert positions[0] == 5 and positions[1] == 9 and positions[6] == 0  # the first two continue cached sequences
    assert all(np.abs(v).max() > 0 for k, v in checker.caches.items())  # warm-up filled every cache


def test_lossy_pass_is_checked_with_its_bound_and_a_drift_decode(tiny):
    model, checker = tiny
    result = run_pipeline(model.graph, [toy_passes.ROUND_STATE], checker=checker)
    (record,) = result.records
    assert record.check["ok"] and 0 < record.check["max_error"] <= 2e-2
    assert 0 < record.check["drift"] <= 2e-2  # measured over 8 teacher-forced decode steps
    assert result.final_check.bound == 2e-2 + REASSOCIATING["f32"]  # the pass's own bound plus the dtype's noise
    with pytest.raises(NumericsError, match="round-state-tight"):
        run_pipeline(model.graph, [toy_passes.ROUND_STATE_TIGHT], checker=checker)
