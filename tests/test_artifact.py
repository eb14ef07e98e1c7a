"""Artifacts: export per shape bucket, run from the directory alone, refuse anything tampered, truncated or foreign."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jaxlib
import numpy as np
import pytest

import qcompile
from qcompile.errors import CheckpointError, UsageError
from qcompile.frontend.tiny import write_tiny
from qcompile.compiler.export import write_artifact
from qcompile.ir.abi import CacheConfig, bucket_shapes
from qcompile.ir.ops.core import Param
from qcompile.runtime.artifact import (DIGEST_KEY, MANIFEST, ExportedProgram, is_artifact, load_artifact,
                                       manifest_digest, sha256_file)
from qcompile.runtime.model import load_model

CACHE = CacheConfig(max_seqs=2, max_context=64, max_step_tokens=16)
PROMPTS = [[3, 17, 42, 9, 250], [(7 * i + 5) % 500 + 3 for i in range(23)]]  # 23 > max_step_tokens: chunked prefill


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny checkpoint, its loaded model, and a CPU artifact written from it (checkpoint deleted afterwards)."""
    root = tmp_path_factory.mktemp("artifact")
    ckpt = write_tiny(root / "ckpt", family="qwen3_5_moe", seed=1)
    model = load_model(ckpt, progress=False)
    out = root / "out"
    manifest = write_artifact(out, model.graph, model.params, config_json=model.checkpoint.config.to_json(),
                              cache=CACHE, target="cpu", extra={"pipeline": "none"}, progress=False)
    shutil.rmtree(ckpt)
    return model, out, manifest


@pytest.fixture
def artifact_copy(built, tmp_path):
    _, out, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    return copy


def refusal(path) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        load_artifact(path)
    err = info.value
    assert err.exit_code == 65
    assert "\n" not in str(err)
    return err


def test_buckets_cover_prefill_and_decode():
    assert bucket_shapes(CACHE) == [(1, 2), (1, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 8), (16, 2), (16, 16)]
    # max_step_tokens rounds up to a power of two; a decode step of max_seqs tokens always has a bucket
    assert max(t for t, _ in bucket_shapes(CacheConfig(max_seqs=2, max_step_tokens=12))) == 16
    assert max(t for t, _ in bucket_shapes(CacheConfig(max_seqs=8, max_step_tokens=4))) == 8


def test_round_trip_matches_checkpoint(built):
    model, out, _ = built
    assert is_artifact(out)
    art = load_artifact(out)
    assert isinstance(art.program, ExportedProgram)
    assert art.config_json["family"] == "qwen3_5_moe"
    assert art.cache_config == CACHE
    assert set(art.params) == set(model.params)
    for name, value in model.params.items():
        np.testing.assert_array_equal(np.asarray(art.params[name]), np.asarray(value))

    got = art.engine().generate(PROMPTS, 6, prompt_logits=True)
    want = model.engine(CACHE).generate(PROMPTS, 6, prompt_logits=True, step_logits=True)
    assert got["tokens"] == want["tokens"] == [[int(np.argmax(x)) for x in steps] for steps in want["step_logits"]]
    for a, b in zip(got["prompt_logits"], want["prompt_logits"]):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    # A step of T tokens uses R = min(T, B) logit rows; the (T, B) buckets with T > B return token ids only, and
    # asking one for logits is a clear usage error. A one-token step uses (1, 1), which has logits.
    engine = art.engine()
    seq = engine.add_sequence()
    assert len(PROMPTS[0]) > CACHE.max_seqs
    assert engine.step_tokens([(seq, PROMPTS[0])]) == [got["tokens"][0][0]]
    (logits,) = engine.step([(seq, [got["tokens"][0][0]])])
    assert int(np.argmax(logits)) == got["tokens"][0][1]
    with pytest.raises(UsageError, match="token ids only"):
        engine.step([(seq, list(PROMPTS[0][:3]))])


def test_manifest_contents(built):
    model, out, manifest = built
    on_disk = json.loads((out / MANIFEST).read_text())
    assert on_disk == manifest
    assert manifest["format_version"] == 3
    weights = manifest["weights"]
    assert weights["mode"] == "copy" and weights["source"] == "artifact"
    assert weights["params"] == {n.op.name: str(n.op.type) for n in model.graph.find(Param)}
    assert manifest["qcompile_version"] == qcompile.__version__
    assert manifest["jax_version"] == jax.__version__
    assert manifest["jaxlib_version"] == jaxlib.__version__
    assert manifest["target"] == "cpu" and manifest["platform"] == "cpu"
    assert "mesh" in manifest and manifest["mesh"] is None
    assert manifest["config"] == json.loads(json.dumps(model.checkpoint.config.to_json()))
    assert manifest["pipeline"] == "none"
    assert manifest["page_size"] == 16
    assert manifest["cache"]["sizes"] == {"B": 2, "M": 4, "P": 8, "S": 2}
    assert set(manifest["cache_types"]) == set(model.graph.meta["caches"])
    assert [(b["tokens"], b["rows"]) for b in manifest["buckets"]] == bucket_shapes(CACHE)
    listed = set(manifest["files"])
    assert listed == {"weights.safetensors", "graph.qir", *(b["file"] for b in manifest["buckets"])}
    on_dir = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {MANIFEST}
    assert on_dir == listed
    for rel, entry in manifest["files"].items():
        assert entry["bytes"] == (out / rel).stat().st_size
        assert entry["sha256"] == sha256_file(out / rel)


def test_tampered_weights_refused(artifact_copy):
    path = artifact_copy / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    err = refusal(artifact_copy)
    assert "weights.safetensors" in str(err) and "sha256" in str(err)


def test_truncated_exec_refused(artifact_copy):
    path = artifact_copy / "exec" / "step_T16_R2.jaxexport"
    path.write_bytes(path.read_bytes()[:1000])
    err = refusal(artifact_copy)
    assert "step_T16_R2.jaxexport" in str(err) and "truncated" in str(err)


def test_missing_exec_refused(artifact_copy):
    (artifact_copy / "exec" / "step_T4_R4.jaxexport").unlink()
    err = refusal(artifact_copy)
    assert "step_T4_R4.jaxexport" in str(err) and "missing" in str(err)


def write_sealed(path: Path, manifest: dict) -> None:
    """An edited manifest with its digest made again (a forged one): the checks behind the digest must still hold."""
    path.write_text(json.dumps({**manifest, DIGEST_KEY: manifest_digest(manifest)}))


def edit_manifest(root: Path, **changes) -> None:
    path = root / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    write_sealed(path, manifest)


def test_a_manifest_edited_after_it_was_written_is_refused(artifact_copy):
    """Each field the manifest holds (sizes, mesh, passes, dtype, vocabulary) is sealed by its digest: an edit is
    one line, exit 65 (a larger max_context or page_size failed inside the first step, exit 1; an edited vocab_size
    let out-of-vocabulary ids through)."""
    path = artifact_copy / MANIFEST
    original = json.loads(path.read_text())
    assert original[DIGEST_KEY] == manifest_digest(original)
    for edit in (lambda m: m["cache"].update(max_context=100000), lambda m: m.update(page_size=32),
                 lambda m: m["config"].update(vocab_size=100000), lambda m: m.update(passes="oops"),
                 lambda m: m.update(compute_dtype="bf16")):
        manifest = json.loads(json.dumps(original))
        edit(manifest)
        path.write_text(json.dumps(manifest))
        err = refusal(artifact_copy)
        assert "edited after it was written" in str(err) and err.exit_code == 65


def test_foreign_target_refused(artifact_copy):
    edit_manifest(artifact_copy, target="tpu", platform="tpu")
    err = refusal(artifact_copy)
    assert "compiled for tpu" in str(err) and "this machine runs cpu" in str(err)
    assert str(artifact_copy) in str(err)


def test_edited_manifest_shapes_caught_by_executables(artifact_copy):
    # Behind the digest (a forged one), the manifest's claims are checked against the (hashed) executables.
    path = artifact_copy / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["cache"]["sizes"]["P"] = 9  # shapes no longer match the exported executables
    write_sealed(path, manifest)
    err = refusal(artifact_copy)
    assert "mismatched artifact" in str(err) and ".jaxexport" in str(err)


def test_format_version_refused(artifact_copy):
    edit_manifest(artifact_copy, format_version=999)
    err = refusal(artifact_copy)
    assert "manifest.json" in str(err) and "999" in str(err) and "format_version 2" in str(err)


@pytest.mark.parametrize("dtype", ["f64", 7, None])
def test_a_forged_compute_dtype_is_refused(artifact_copy, dtype):
    """Behind the digest (re-sealed), an unknown compute_dtype is one line, exit 65 (`check` took it as the dtype of
    its reference build and exited 2, as if the user had asked for it)."""
    edit_manifest(artifact_copy, compute_dtype=dtype)
    err = refusal(artifact_copy)
    assert "malformed compute_dtype" in str(err) and err.exit_code == 65


def test_manifest_config_without_a_vocabulary_refused(artifact_copy):
    manifest = json.loads((artifact_copy / MANIFEST).read_text())
    edit_manifest(artifact_copy, config={**manifest["config"], "vocab_size": -1})
    err = refusal(artifact_copy)
    assert "manifest.json" in str(err) and "malformed config (vocab_size -1)" in str(err)


def test_manifest_not_json_refused(artifact_copy):
    (artifact_copy / MANIFEST).write_text("{not json")
    err = refusal(artifact_copy)
    assert "manifest.json" in str(err) and "JSON" in str(err)


def test_missing_manifest_refused(artifact_copy):
    (artifact_copy / MANIFEST).unlink()
    err = refusal(artifact_copy)
    assert "manifest.json" in str(err) and "missing" in str(err)
    assert not is_artifact(artifact_copy)


def test_undeserializable_exec_refused_with_versions(artifact_copy):
    # A file this jax cannot read (as an executable from an incompatible jax would be), with a matching hash.
    rel = "exec/step_T1_R1.jaxexport"
    (artifact_copy / rel).write_bytes(b"\x00" * 64)
    path = artifact_copy / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"][rel] = {"sha256": sha256_file(artifact_copy / rel), "bytes": 64}
    manifest["jax_version"] = "0.0.1"
    write_sealed(path, manifest)
    err = refusal(artifact_copy)
    assert "step_T1_R1.jaxexport" in str(err)
    assert "jax 0.0.1" in str(err) and f"jax {jax.__version__}" in str(err)


def test_tpu_target_exports_here_and_refuses_to_run(built, tmp_path):
    model, _, _ = built
    small = CacheConfig(max_seqs=2, max_context=64, max_step_tokens=16)
    manifest = write_artifact(tmp_path / "tpu", model.graph, model.params,
                              config_json=model.checkpoint.config.to_json(), cache=small, target="tpu",
                              progress=False)
    assert manifest["target"] == "tpu" and manifest["platform"] == "tpu"
    assert all((tmp_path / "tpu" / b["file"]).stat().st_size > 0 for b in manifest["buckets"])
    err = refusal(tmp_path / "tpu")
    assert "artifact was compiled for tpu; this machine runs cpu" in str(err)


def test_refuses_to_clobber_unrelated_directory(built, tmp_path):
    model, _, _ = built
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(UsageError):
        write_artifact(mine, model.graph, model.params, config_json={}, cache=CACHE, progress=False)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert (mine / "notes.txt").read_text() == "precious"


def test_writes_into_empty_or_interrupted_directories(built, tmp_path):
    model, _, _ = built
    small = CacheConfig(max_seqs=1, max_context=32, max_step_tokens=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    write_artifact(empty, model.graph, model.params, config_json={}, cache=small, progress=False)
    assert is_artifact(empty)
    # an interrupted write leaves its marker and no manifest: load says so, and a rerun may overwrite it
    (empty / MANIFEST).unlink()
    (empty / ".qcompile-writing").write_text("")
    assert "interrupted" in str(refusal(empty))
    write_artifact(empty, model.graph, model.params, config_json={}, cache=small, progress=False)
    assert not (empty / ".qcompile-writing").exists()
    load_artifact(empty)


def test_overwrites_an_existing_artifact(built, tmp_path):
    model, out, _ = built
    copy = tmp_path / "again"
    shutil.copytree(out, copy)
    small = CacheConfig(max_seqs=1, max_context=32, max_step_tokens=1)
    manifest = write_artifact(copy, model.graph, model.params, config_json={}, cache=small, progress=False)
    assert [(b["tokens"], b["rows"]) for b in manifest["buckets"]] == [(1, 1)]
    assert sorted(p.name for p in (copy / "exec").iterdir()) == ["step_T1_R1.jaxexport"]
    art = load_artifact(copy)
    assert art.program.buckets == [(1, 1)]
    with pytest.raises(UsageError):
        art.program.token_bucket(2)


_CACHE_PROBE = """
import sys, jax.monitoring
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
from qcompile.runtime.artifact import load_artifact
art = load_artifact(sys.argv[1])
tokens = art.engine().generate([[3, 17, 42, 9]], 3)["tokens"]
print(sum(h == "/jax/compilation_cache/cache_hits" for h in hits), tokens)
"""


def test_second_run_of_an_artifact_loads_compiled_executables(built, tmp_path):
    """The persistent compilation cache keyed by the artifact: a second process compiles nothing it already did."""
    import os
    import subprocess
    import sys

    _, out, _ = built
    env = {**os.environ, "QCOMPILE_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    runs = [subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(out)], env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    (cold_hits, cold_tokens), (warm_hits, warm_tokens) = [r.stdout.strip().split(" ", 1) for r in runs]
    assert int(cold_hits) == 0 and int(warm_hits) >= 2  # at least the prefill and the decode bucket
    assert cold_tokens == warm_tokens
    entries = list((tmp_path / "cache" / "xla").iterdir())
    assert len(entries) == 1 and any(entries[0].iterdir())  # one directory, keyed by this artifact


def test_an_artifact_samples_at_every_step_shape(built):
    """The R = B buckets of an artifact return greedy ids only; a sampled step whose bucket has more tokens than slots
    (a prefill chunk beside a decode) used to fail — the server then refused every request. Sampled steps take the
    R = T buckets' logits, each item's last row: the draws equal the in-process model's on the same logits."""
    from qcompile.runtime.sampling import Sampling

    model, out, _ = built
    art = load_artifact(out)
    assert not art.program.samples  # the R = B buckets carry no logits
    draws = []
    for engine in (art.engine(), model.engine(CACHE)):
        a, b = engine.add_sequence(), engine.add_sequence()
        work = [(a, [3, 17, 42, 9, 5]), (b, [7])]  # 6 tokens: a T = 8 bucket over 2 slots
        sampling = [Sampling(0.9, 0, 1.0, 5), Sampling(0.7, 4, 0.9, 6)]
        draws.append(engine.step_tokens(work, sampling, [0, 0]))
    assert draws[0] == draws[1] and all(0 <= t < model.checkpoint.config.vocab_size for t in draws[0])


def test_an_artifacts_penalised_requests_make_the_in_process_tokens(built):
    """Penalised requests through the scheduler (pipelined: each step counts the token still on the device) make the
    same tokens from the artifact as from the in-process model; the presence penalty leaves no token made twice."""
    from qcompile.runtime.sampling import Sampling
    from qcompile.runtime.scheduler import Request, Scheduler

    model, out, _ = built
    made = []
    for engine in (load_artifact(out).engine(), model.engine(CACHE)):
        requests = [Request([3, 17, 42, 9, 5], 10, sampling=Sampling(presence_penalty=2.0)),
                    Request([7, 8], 10, sampling=Sampling(0.8, 5, 0.9, 3, frequency_penalty=1.0,
                                                          repetition_penalty=1.2))]
        Scheduler(engine).run(requests)
        made.append([r.tokens for r in requests])
    assert made[0] == made[1] and len(set(made[0][0])) == len(made[0][0]) == 10
