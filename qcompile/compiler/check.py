"""`qcompile check`: the optimized model against its unoptimized reference on the user's own prompts.

The compile-time checker compares each pass on a few random tokens; a user deciding whether an optimized build (a
lossy pass such as bf16-state above all) is good enough for their work needs the comparison on their prompts, over
a real generation. For each prompt the reference (the checkpoint's unoptimized graph) generates greedily for
`max_new_tokens` steps; the candidate (an artifact, or the checkpoint compiled in-process with `--passes`) is fed the
same tokens, teacher-forced, one decode step at a time, so its caches and recurrent states evolve exactly as in
serving. At every step both next-token distributions are compared:

- top-1 agreement: the fraction of steps whose argmax agrees;
- KL(reference ‖ candidate) of the softmax distributions (float64), mean and max over the steps;
- the first step where the greedy tokens diverge (None when they never do).

Overall figures pool every step of every prompt. Exit 3 (numerics) when the overall agreement is under
`--min-agreement`. Prompts: JSON lines, `{"prompt_ids": [...]}`, `{"prompt": "..."}` when the checkpoint has a
`tokenizer.json` (read with the `tokenizers` library), or `{"messages": [...]}` (a conversation, rendered with the
checkpoint's chat template and the assistant's turn opened, as `serve`'s chat API renders it: frontend/chat.py).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import attrs
import numpy as np

from qcompile.errors import NumericsError, UsageError
from qcompile.frontend.chat import ChatError, encode_chat, load_chat_template, text_messages
from qcompile.frontend.tokenizer import load_tokenizer
from qcompile.ir.abi import MAX_CONTEXT, CacheConfig


@attrs.frozen
class CheckOptions:
    source: Path
    prompts: Path
    reference: Path | None = None
    passes: str | None = None  # a checkpoint's candidate passes (None: all); an artifact carries its own
    max_new_tokens: int = 32
    min_agreement: float = 0.99
    json_path: Path | None = None


# The config fields that make two checkpoints the same architecture: an artifact's reference must match them all.
ARCHITECTURE_KEYS = ("family", "hidden_size", "num_layers", "layer_types", "num_heads", "num_kv_heads", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "conv_kernel", "num_experts", "top_k", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "intermediate_size", "moe_layers")


def _plain(value):
    """JSON's view of a config value (tuples as lists), for comparing a manifest's config with a loaded one."""
    return json.loads(json.dumps(value, default=str))


MAX_PROMPTS_BYTES = 256 << 20


def read_prompts(path: Path, checkpoint_dir: Path | None, vocab_size: int) -> list[list[int]]:
    """Prompt token ids from a JSON-lines file; every problem is a UsageError naming the line."""
    if not path.exists():
        raise UsageError(f"--prompts {path}: file not found")
    if path.is_dir():
        raise UsageError(f"--prompts {path}: is a directory; give a JSON-lines file")
    try:  # a pipe (/dev/stdin) too; read with a cap, so /dev/zero cannot fill the memory
        with path.open("rb") as stream:
            data = stream.read(MAX_PROMPTS_BYTES + 1)
    except OSError as err:
        raise UsageError(f"--prompts {path}: cannot read it ({err.strerror or err})") from None
    if len(data) > MAX_PROMPTS_BYTES:
        raise UsageError(f"--prompts {path}: more than {MAX_PROMPTS_BYTES >> 20} MiB of prompts; split the file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise UsageError(f"--prompts {path}:{line}: not UTF-8 text (give JSON lines)") from None
    tokenizer = template = None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"--prompts {path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict) or sum(key in record for key in ("prompt_ids", "prompt", "messages")) != 1:
            raise UsageError(f"--prompts {path}:{number}: expected an object with one of prompt_ids, prompt or "
                             "messages")
        if "messages" in record:
            if tokenizer is None:
                tokenizer = _tokenizer(checkpoint_dir, path, number)
            if template is None:
                template = load_chat_template(checkpoint_dir)
                if template is None:
                    raise UsageError(f"--prompts {path}:{number}: messages need the checkpoint's chat template "
                                     "(chat_template.jinja, or tokenizer_config.json's chat_template)")
            try:
                ids = encode_chat(tokenizer, template, text_messages(record["messages"]))
            except ChatError as err:
                raise UsageError(f"--prompts {path}:{number}: {err}") from None
            if not ids:
                raise UsageError(f"--prompts {path}:{number}: the conversation renders to no tokens")
        elif "prompt" in record:
            if tokenizer is None:
                tokenizer = _tokenizer(checkpoint_dir, path, number)
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise UsageError(f"--prompts {path}:{number}: prompt must be a non-empty string")
            ids = tokenizer.encode(record["prompt"]).ids
        else:
            ids = record["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in ids):
                raise UsageError(f"--prompts {path}:{number}: prompt_ids must be a non-empty list of integers")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise UsageError(f"--prompts {path}:{number}: token id {bad[0]} is outside the vocabulary "
                             f"(0..{vocab_size - 1})")
        prompts.append(list(ids))
    if not prompts:
        raise UsageError(f"--prompts {path}: no prompts (one JSON object per line)")
    return prompts


def _tokenizer(checkpoint_dir: Path | None, path: Path, number: int):
    return load_tokenizer(checkpoint_dir, f"--prompts {path}:{number}: a text prompt")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max()
    return shifted - math.log(np.exp(shifted).sum())


def compare_steps(reference: list[np.ndarray], candidate: list[np.ndarray]) -> dict:
    """Per-step top-1 agreement and KL(reference ‖ candidate) of two lists of next-token logits."""
    agree, kls = [], []
    for ref, cand in zip(reference, candidate):
        agree.append(int(np.argmax(ref)) == int(np.argmax(cand)))
        lp, lq = _log_softmax(ref), _log_softmax(cand)
        kls.append(float(np.sum(np.exp(lp) * (lp - lq))))
    first = next((i for i, ok in enumerate(agree) if not ok), None)
    return {"steps": len(agree), "top1_agreement": float(np.mean(agree)), "kl_mean": float(np.mean(kls)),
            "kl_max": float(np.max(kls)), "first_divergence": first, "_agree": agree, "_kl": kls}


def teacher_forced_logits(engine, prompts: list[list[int]], forced: list[list[int]] | None, steps: int):
    """Next-token logits at each of `steps` steps per prompt: after the prompt, then after each forced token (or the
    engine's own greedy token when `forced` is None). Returns (logits per prompt, tokens per prompt)."""
    seqs = [engine.add_sequence() for _ in prompts]
    try:
        # all_logits: artifacts export logits only for all-token steps (decode executables return token ids)
        last = [x[-1] for x in engine.prefill(list(zip(seqs, prompts)), all_logits=True)]
        logits = [[np.asarray(x)] for x in last]
        tokens = [[int(np.argmax(x))] if forced is None else [forced[i][0]] for i, x in enumerate(last)]
        for step in range(1, steps):
            out = engine.step([(s, [tokens[i][-1]]) for i, s in enumerate(seqs)], all_logits=True)
            for i, x in enumerate(x[-1] for x in out):
                logits[i].append(np.asarray(x))
                tokens[i].append(int(np.argmax(x)) if forced is None else forced[i][step])
        return logits, tokens
    finally:
        for seq in seqs:
            engine.release(seq)


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield start, items[start:start + size]


def run_check(opts: CheckOptions, emit=print) -> dict:
    from qcompile.frontend.checkpoint import Checkpoint
    from qcompile.runtime.artifact import is_artifact, load_artifact
    from qcompile.runtime.model import load_model

    if opts.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {opts.max_new_tokens}")
    if not 0.0 <= opts.min_agreement <= 1.0:
        raise UsageError(f"--min-agreement must be within 0..1, got {opts.min_agreement}")
    if opts.json_path is not None and not Path(opts.json_path).parent.resolve().is_dir():
        raise UsageError(f"--json {opts.json_path}: directory {Path(opts.json_path).parent} does not exist")
    log = lambda text: print(f"qcompile check: {text}", file=sys.stderr, flush=True)  # noqa: E731
    if is_artifact(opts.source):
        if opts.passes is not None:
            raise UsageError(f"--passes {opts.passes}: {opts.source} is an artifact, compiled with its passes already "
                             "(--passes chooses the passes of a checkpoint checked in-process)")
        if opts.reference is None:
            raise UsageError(f"check {opts.source}: an artifact needs --reference CHECKPOINT, the unoptimized model "
                             "to compare it with")
        log(f"loading the artifact {opts.source}")
        artifact = load_artifact(opts.source)
        if artifact.weights_note:
            print(artifact.weights_note, file=sys.stderr)
        info = artifact.manifest.get("passes") or {}
        records = info.get("passes")  # what ran: a selected pass that did not apply (one device, ...) is not listed
        selected = [r["name"] for r in records if r.get("status") != "skipped"] if records else info.get("selected")
        passes = ", ".join(selected) or "none" if selected is not None else artifact.manifest.get("pipeline", "?")
        candidate_label = f"artifact {opts.source} (passes {passes})"
        ref_dir = Path(opts.reference)
        dtype, page_size = artifact.manifest.get("compute_dtype"), int(artifact.manifest["page_size"])
        vocab = int(artifact.config_json["vocab_size"])
        prompts = read_prompts(Path(opts.prompts), ref_dir, vocab)
        cache = artifact.cache_config
        context = max(len(p) for p in prompts) + opts.max_new_tokens
        if context > cache.max_context:
            raise UsageError(f"a prompt of {context - opts.max_new_tokens} tokens plus {opts.max_new_tokens} new "
                             f"ones needs a context of {context}; the artifact holds {cache.max_context} "
                             "(lower --max-new-tokens, or compile with a larger --max-context)")
        make_candidate = lambda reference: artifact.engine()  # noqa: E731
        artifact_config = artifact.config_json
    else:
        ref_dir = Path(opts.reference or opts.source)
        artifact_config = None  # a checkpoint against another: same-shape models are compared (a different seed fails 3)
        ckpt = Checkpoint.open(opts.source)
        dtype, page_size, vocab = None, 16, ckpt.config.vocab_size
        prompts = read_prompts(Path(opts.prompts), Path(opts.source), vocab)
        context = max(len(p) for p in prompts) + opts.max_new_tokens
        if context > MAX_CONTEXT:
            raise UsageError(f"--max-new-tokens {opts.max_new_tokens}: the longest prompt plus the new tokens need a "
                             f"context of {context} tokens; qcompile supports up to {MAX_CONTEXT}")
        cache = CacheConfig(max_seqs=min(8, len(prompts)), max_context=context, max_step_tokens=512)
        passes_spec = opts.passes or "all"
        candidate_label = f"{opts.source} (passes {passes_spec})"

        def make_candidate(reference):
            from qcompile.runtime.engine import Engine

            log(f"compiling {opts.source} with --passes {passes_spec}")
            same = ref_dir.resolve() == Path(opts.source).resolve()  # then its weights are read once, not twice
            graph, params = _compile_in_process(ckpt, passes_spec, reference.params if same else None)
            return Engine(graph, params, cache)
    log(f"loading the reference {ref_dir}")
    reference = load_model(ref_dir, dtype, page_size=page_size, progress=False)
    if reference.checkpoint.config.vocab_size != vocab:
        raise UsageError(f"--reference {ref_dir} has a vocabulary of {reference.checkpoint.config.vocab_size}, the "
                         f"candidate {vocab}: not the same model")
    if artifact_config is not None:
        ref_config = attrs.asdict(reference.checkpoint.config)
        differ = [key for key in ARCHITECTURE_KEYS if key in artifact_config
                  and _plain(artifact_config[key]) != _plain(ref_config.get(key))]
        if differ:
            key = differ[0]
            raise UsageError(f"--reference {ref_dir} is not the model the artifact was compiled from: its {key} is "
                             f"{ref_config.get(key)!r}, the artifact's {artifact_config[key]!r}"
                             + (f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""))
    ref_engine = reference.engine(CacheConfig(max_seqs=cache.max_seqs, max_context=cache.max_context,
                                              max_step_tokens=cache.max_step_tokens))
    cand_engine = make_candidate(reference)
    per_prompt = []
    for start, batch in _batches(prompts, cache.max_seqs):
        log(f"prompts {start + 1}-{start + len(batch)} of {len(prompts)}: {opts.max_new_tokens} steps each")
        ref_logits, ref_tokens = teacher_forced_logits(ref_engine, batch, None, opts.max_new_tokens)
        cand_logits, _ = teacher_forced_logits(cand_engine, batch, ref_tokens, opts.max_new_tokens)
        for offset, (r, c) in enumerate(zip(ref_logits, cand_logits)):
            per_prompt.append({"prompt": start + offset, "prompt_tokens": len(batch[offset]), **compare_steps(r, c)})
    agree = [a for p in per_prompt for a in p.pop("_agree")]
    kls = [k for p in per_prompt for k in p.pop("_kl")]
    overall = {"steps": len(agree), "top1_agreement": float(np.mean(agree)), "kl_mean": float(np.mean(kls)),
               "kl_max": float(np.max(kls)),
               "prompts_diverged": sum(p["first_divergence"] is not None for p in per_prompt)}
    report = {"candidate": candidate_label, "reference": str(ref_dir), "max_new_tokens": opts.max_new_tokens,
              "min_agreement": opts.min_agreement, "overall": overall, "prompts": per_prompt,
              "ok": overall["top1_agreement"] >= opts.min_agreement}
    emit(f"candidate: {candidate_label}\nreference: {ref_dir} (unoptimized)")
    emit(f"{'prompt':>6} {'tokens':>6} {'steps':>5} {'top-1':>7} {'KL mean':>10} {'KL max':>10}  first divergence")
    for p in per_prompt:
        emit(f"{p['prompt']:>6} {p['prompt_tokens']:>6} {p['steps']:>5} {p['top1_agreement']:>7.3f} "
             f"{p['kl_mean']:>10.2e} {p['kl_max']:>10.2e}  "
             f"{'-' if p['first_divergence'] is None else 'step ' + str(p['first_divergence'])}")
    emit(f"overall: {overall['steps']} steps, top-1 agreement {overall['top1_agreement']:.4f} (minimum "
         f"{opts.min_agreement}), KL mean {overall['kl_mean']:.2e} max {overall['kl_max']:.2e}, "
         f"{overall['prompts_diverged']} of {len(per_prompt)} prompts diverged")
    if opts.json_path is not None:
        Path(opts.json_path).write_text(json.dumps(report, indent=2) + "\n")
    if not report["ok"]:
        raise NumericsError(f"top-1 agreement {overall['top1_agreement']:.4f} is under --min-agreement "
                            f"{opts.min_agreement}")
    return report


def _compile_in_process(ckpt, spec: str, loaded: dict | None):
    """The checkpoint's graph through the selected passes (structurally verified), folded, with its parameters
    (arrays already in `loaded` — the reference's, from the same checkpoint — are reused, not read again)."""
    from qcompile.ir.importer import build_graph
    from qcompile.ir.lowering import host_target
    from qcompile.ir.weights import fold_weight_preparation, load_params
    from qcompile.passes.base import PassContext
    from qcompile.passes.manager import run_pipeline
    from qcompile.passes.registry import parse_spec

    graph = build_graph(ckpt)
    result = run_pipeline(graph, parse_spec(spec), PassContext(), verify_mode="none")
    folded = fold_weight_preparation(result.graph, host_target())
    return folded, load_params(ckpt, folded, progress=False, loaded=loaded)
