"""The `qcompile` command line (design.md §8). `compile` is the default command.

Exit codes: 0 ok · 1 internal error · 2 usage · 3 numerics check failed · 4 IR verification failed ·
65 bad input (unreadable or malformed checkpoint, config that does not match the tensors).
Errors print one line on stderr; set QCOMPILE_DEBUG=1 to see the traceback of an internal error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import click

from qcompile import __version__
from qcompile.errors import CheckpointError, QCompileError, UsageError, one_line

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


class DefaultGroup(click.Group):
    """A group that runs `compile` when the first argument is not a command name."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help", "--version"):
            word = args[0]
            if not word.startswith("-") and not os.path.exists(word) and not any(c in word for c in "/\\."):
                raise UsageError(f"'{word}' is neither a command nor a checkpoint path; the commands are "
                                 f"{', '.join(sorted(self.commands))} (qcompile --help)")
            args = ["compile", *args]
        return super().parse_args(ctx, args)


def _size_option(ctx, param, value):
    """A --memory-budget style size option, parsed to bytes (a usage error, exit 2, when it is not a size)."""
    if value is None:
        return None
    from qcompile.runtime.memory import parse_size

    try:
        return parse_size(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


@click.group(cls=DefaultGroup, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="qcompile")
def cli():
    """qcompile: compile Qwen3.5-MoE / Qwen3-Next checkpoints into checked JAX executables.

    \b
    qcompile [compile] [--passes SPEC] [-o OUT] CHECKPOINT   build, optimize, check and export the step graph
    qcompile run CHECKPOINT|OUT --prompt-ids 1,2,3           generate: greedy, or --temperature (checkpoint or artifact)
    qcompile bench CHECKPOINT|OUT [--compare transformers]    throughput, latency and % of roofline
    qcompile check OUT|CHECKPOINT --prompts FILE             optimized vs unoptimized on your prompts
    qcompile serve CHECKPOINT|OUT [--port 8000]               OpenAI completions + chat server (continuous batching)
    qcompile plan CONFIG|CHECKPOINT --target tpu7x --chips 4  per-device memory and step cost of a deployment
    qcompile passes                                          list the optimization passes
    qcompile reproduce DIR                                   re-run a numerics failure's reproducer
    qcompile init-tiny DIR --family qwen3_5_moe              write a random HF-format checkpoint

    CHECKPOINT is a directory with config.json, a model.safetensors file with config.json beside it, or a
    model.safetensors.index.json. Exit codes: 0 ok, 1 internal error, 2 usage, 3 numerics check failed,
    4 IR verification failed, 65 bad input.
    """


@cli.command("compile", context_settings=CONTEXT)
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--passes", "passes_spec", default="all", show_default=True, metavar="SPEC",
              help="Passes to run: all, none, a,b or all,-a (left to right, last mention wins). See `qcompile passes`.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Write the artifact here: exported executables, weights, manifest.json, graph.qir, report.json.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Also write the JSON report here.")
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), help="Compute dtype (default: the checkpoint's).")
@click.option("--page-size", type=int, metavar="N",
              help="Fix the KV cache page length in tokens (a power of two). Default: the kv-page-resize pass picks "
                   "the target's (16 on cpu and gpu, 256 on tpu); without that pass, 16.")
@click.option("--memory-budget", metavar="SIZE", callback=_size_option,
              help="Memory the model will be given (e.g. 96GiB): kv-page-resize reports the KV capacity it holds.")
@click.option("--target", type=click.Choice(["cpu", "gpu", "tpu"]), default="cpu", show_default=True,
              help="Platform the artifact is exported for (tpu and gpu artifacts can be built here, not run).")
@click.option("--verify", type=click.Choice(["each", "final", "none"]), default="each", show_default=True,
              help="Numerics checks: after each pass and at the end, only at the end, or none.")
@click.option("--verify-layers", type=int, metavar="N",
              help="Check numerics on a slice of N real layers of each type (for models too large to run whole).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seed of the numerics check inputs.")
@click.option("--print-ir-after", "print_ir_after", multiple=True, metavar="PASS|all",
              help="Print the IR (stderr) after this pass; repeatable.")
@click.option("--print-ir-after-change", is_flag=True, help="Print the IR (stderr) after every pass that changed it.")
@click.option("--dump-dir", type=click.Path(path_type=Path), help="Write 000_input.qir, 001_<pass>.qir, ... here.")
@click.option("--repro-dir", type=click.Path(path_type=Path),
              help="Where a failing numerics check writes its reproducer (default ./qcompile-repro).")
@click.option("--max-seqs", default=4, show_default=True, help="Artifact: concurrent sequences (batch slots).")
@click.option("--max-context", default=512, show_default=True, help="Artifact: longest sequence in tokens.")
@click.option("--max-step-tokens", default=64, show_default=True,
              help="Artifact: largest token bucket; longer prompts are prefilled in chunks.")
@click.option("--num-pages", type=int, metavar="N",
              help="Artifact: KV page pool size in pages (default: enough for --max-seqs full sequences).")
@click.option("--weights", "weights_mode", type=click.Choice(["copy", "link", "none"]), default="copy",
              show_default=True,
              help="Artifact weights: copy (prepared weights streamed into the artifact), link (hard links to the "
                   "checkpoint's files, else references by path and hash; weights made from them at load), none "
                   "(executables and manifest only; run reads the checkpoint at its path).")
@click.option("--mesh", "mesh_spec", metavar="SPEC",
              help="Lay the model out on a device mesh: 8 (one axis), 4x2 (chips x cores), 2x4 (processes x "
                   "devices). On this host qcompile creates that many CPU devices itself.")
@click.option("--concurrency", type=click.IntRange(min=1), metavar="N",
              help="Expected concurrent sequences, for gqa-sharding's plan choice (default: --max-seqs).")
@click.option("--layout", metavar="PLAN",
              help="gqa-sharding's plan instead of its choice: dp8, dp4xtp2, tp2, ... (data-parallel ranks x "
                   "tensor-parallel degree; tensor parallelism runs over the mesh's innermost axes). The report lists "
                   "every plan.")
@click.option("--fp8", "fp8_mode", type=click.Choice(["keep", "dequantize"]), default="keep", show_default=True,
              help="An FP8 checkpoint's quantized weights: keep (FP8 in memory and in the artifact, dequantized "
                   "inside the matmul kernels; one byte a weight) or dequantize (multiplied out to the compute dtype "
                   "when read; what tensor parallelism needs today).")
def compile_cmd(checkpoint, passes_spec, output, report_path, dtype, page_size, memory_budget, target, verify,
                verify_layers, seed, print_ir_after, print_ir_after_change, dump_dir, repro_dir, max_seqs, max_context,
                max_step_tokens, num_pages, weights_mode, mesh_spec, concurrency, layout, fp8_mode):
    """Load CHECKPOINT, build and verify the step graph, run and check the selected passes, write the artifact."""
    from qcompile.ir.abi import CacheConfig

    # Every size and output path is checked before any work: a bad flag is a one-line usage error (exit 2) naming
    # the flag, never a failure (or an artifact that cannot run) minutes later.
    cache = CacheConfig(max_seqs=max_seqs, max_context=max_context, max_step_tokens=max_step_tokens,
                        num_pages=num_pages)
    if page_size is not None:
        _check_page_size(page_size)
    if verify_layers is not None and verify_layers < 1:
        raise UsageError(f"--verify-layers must be a positive integer, got {verify_layers}")
    if output is not None:
        _check_output_dir(output, "-o")
        _check_artifact_target(output)
        if output.resolve() == checkpoint.resolve() or output.resolve() in checkpoint.resolve().parents:
            raise UsageError(f"-o {output}: the checkpoint {checkpoint} lies inside it, and writing the artifact "
                             "replaces the directory; choose another -o")
    if report_path is not None:
        _check_output_file(report_path, "--report", (checkpoint, output))
    if dump_dir is not None:
        _check_output_dir(dump_dir, "--dump-dir")
        _refuse_overwriting_inputs(dump_dir, "--dump-dir", (checkpoint,))
    if repro_dir is not None:
        _check_output_dir(repro_dir, "--repro-dir")
        _refuse_overwriting_inputs(repro_dir, "--repro-dir", (checkpoint,))
    if layout is not None and mesh_spec is None:
        raise UsageError("--layout needs --mesh (the plan lays the model out on the mesh's devices)")
    mesh = _setup_mesh(mesh_spec)
    from qcompile.compiler.driver import CompileOptions, compile_checkpoint

    opts = CompileOptions(
        checkpoint=checkpoint, passes=passes_spec, output=output, report=report_path, dtype=dtype,
        page_size=page_size, memory_budget=memory_budget, target=target, verify=verify, verify_layers=verify_layers, seed=seed,
        print_ir_after=tuple(print_ir_after), print_ir_after_change=print_ir_after_change, dump_dir=dump_dir,
        repro_dir=repro_dir, cache=cache, weights=weights_mode, mesh=mesh, concurrency=concurrency, layout=layout,
        fp8=fp8_mode)
    report = compile_checkpoint(opts, emit=click.echo)
    click.echo(f"done in {report['compile_seconds']:.1f}s")


@cli.command("passes", context_settings=CONTEXT)
def passes_cmd():
    """List every registered pass: name, summary, whether `all` selects it, tolerance class, requirements, and what it
    buys on the cpu target (or why `all` keeps it there)."""
    from qcompile.passes.registry import PASSES

    if not PASSES:
        click.echo("no passes are registered yet; --passes accepts all and none")
        return
    click.echo(f"{'pass':<26} {'in all':<7} {'tolerance':<14} {'requires':<24} summary")
    for p in PASSES.values():
        requires = ", ".join(p.requires) or "-"
        click.echo(f"{p.name:<26} {'yes' if p.in_all else 'no':<7} {p.tolerance:<14} {requires:<24} {p.summary}")
        if p.cpu_note:
            click.echo(f"{'':<26} on cpu: {p.cpu_note}")


@cli.command("reproduce", context_settings=CONTEXT)
@click.argument("directory", type=click.Path(path_type=Path))
def reproduce_cmd(directory):
    """Re-run a numerics failure from the reproducer DIRECTORY a failed compile wrote."""
    from qcompile.compiler.reproduce import reproduce, reproducer_devices

    count = reproducer_devices(directory)  # a failure on a mesh replays on as many (host) devices
    if count > 1:
        use_host_devices(count)
    ok, line = reproduce(directory)
    click.echo(line)
    if not ok:
        from qcompile.errors import NumericsError

        raise NumericsError(f"still failing: {line}")


def _parse_ids(text: str) -> list[int]:
    if not text.strip():
        raise UsageError("--prompt-ids is empty")
    parts = [part.strip() for part in text.split(",")]
    if "" in parts:
        raise UsageError(f"--prompt-ids {text!r} has an empty id; give comma-separated integers such as 1,2,3")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _setup_mesh(spec: str | None, cluster=None):
    """The Mesh of a --mesh SPEC (None without one), with this host's JAX given that many CPU devices — or, with
    `cluster` (--coordinator ...), this process's share of them, joined to the other processes: JAX fixes its
    devices when it starts, so this runs before anything touches a device."""
    if spec is None:
        return None
    from qcompile.ir.mesh import parse_mesh_spec

    try:
        mesh = parse_mesh_spec(spec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if cluster is not None:
        cluster.join(mesh.size)
    else:
        use_host_devices(mesh.size)
    return mesh


def _artifact_devices(path: Path, cluster=None) -> None:
    """Give JAX the devices an artifact's mesh needs (a laid-out artifact records its mesh), before it starts."""
    from qcompile.runtime.artifact import artifact_devices

    count = artifact_devices(path)
    if cluster is not None:
        if count == 1:
            raise UsageError(f"{path} runs on one device; several processes need a laid-out artifact (compile it "
                             "with --mesh)")
        cluster.join(count)
    elif count > 1:
        use_host_devices(count)


def _penalty_options(command):
    """--min-p and the penalties of `run` and `bench` (runtime/sampling.py; `bench` applies them to transformers too)."""
    for option in reversed((
            click.option("--min-p", default=0.0, show_default=True, type=float,
                         help="With --temperature: keep the tokens at least P times as likely as the most likely "
                              "(0: off)."),
            click.option("--presence-penalty", default=0.0, show_default=True, type=float,
                         help="Subtract this (-2..2) from the logit of every token already made (OpenAI's; greedy "
                              "too)."),
            click.option("--frequency-penalty", default=0.0, show_default=True, type=float,
                         help="Subtract this (-2..2) times the times a token was made from its logit (OpenAI's; "
                              "greedy too)."),
            click.option("--repetition-penalty", default=1.0, show_default=True, type=float,
                         help="Divide a positive logit (multiply a negative one) by R for every token of the prompt "
                              "or made so far (Hugging Face's; 1: off; greedy too)."))):
        command = option(command)
    return command


def _cluster_options(command):
    """--coordinator / --num-processes / --process-id: one of N cooperating processes (runtime/distributed.py)."""
    for option in reversed((
            click.option("--coordinator", metavar="HOST:PORT",
                         help="Run as one of several processes sharing the mesh (jax.distributed, gloo collectives "
                              "on CPU); process 0 serves the coordinator at this address. With --num-processes "
                              "and --process-id; the mesh (--mesh, or the artifact's) is split over the processes, "
                              "outer axis first (--mesh 2x4: 2 processes x 4 devices)."),
            click.option("--num-processes", type=int, metavar="N", help="How many processes (with --coordinator)."),
            click.option("--process-id", type=int, metavar="I", help="This process, 0..N-1 (with --coordinator); "
                                                                       "process 0 prints the results."),
            click.option("--join-timeout", type=float, default=120, show_default=True, metavar="SECONDS",
                         help="How long a process waits for the others to start (with --coordinator)."))):
        command = option(command)
    return command


def _cluster(coordinator, num_processes, process_id, join_timeout):
    from qcompile.runtime.distributed import Cluster

    return Cluster.from_options(coordinator, num_processes, process_id, join_timeout)


def use_host_devices(count: int) -> None:
    """Give JAX `count` host (CPU) devices, or exit 2 when it already started with fewer."""
    from qcompile.ir.mesh import request_host_devices

    available = request_host_devices(count)
    if available < count:
        raise UsageError(f"--mesh needs {count} devices, but JAX started with {available} in this process; run "
                         "qcompile in a fresh process")


def _check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or page_size <= 0 or page_size & (page_size - 1) or page_size > 65536:
        raise UsageError(f"--page-size must be a power of two from 1 to 65536, got {page_size}")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_output_dir(path: Path, flag: str) -> None:
    """`path` is, or can be created as, a writable directory (checked before any work: a probe directory is made
    and removed in its nearest existing ancestor — permission bits do not tell for root or for /proc)."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UsageError(f"{flag} {path}: cannot create it, {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {base} is not writable")
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qcompile-probe-", dir=base))
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot be written in {base} ({err.strerror or err})") from None


def _check_artifact_target(out: Path) -> None:
    """-o must not be a non-empty directory that is not an artifact (export would refuse it only after compiling)."""
    from qcompile.runtime.artifact import is_artifact

    if out.is_dir() and any(out.iterdir()) and not is_artifact(out):
        raise UsageError(f"-o {out}: directory is not empty and is not a qcompile artifact; refusing to overwrite it "
                         "— choose another -o or empty it")


def _check_output_file(path: Path, flag: str, inputs: tuple = ()) -> None:
    """`path` can be written as a file — its directory exists and a file can be created there (tried: permission
    bits do not tell for root or for /proc) — and writing it destroys none of `inputs` (files, or directories whose
    contents are inputs). Checked before any work."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    parent = path.absolute().parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"{flag} {path}: directory {parent} {why}")
    _refuse_overwriting_inputs(path, flag, inputs)
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    if not path.exists():
        try:
            with open(path, "x"):
                pass
            path.unlink()
        except OSError as err:
            raise UsageError(f"{flag} {path}: cannot be written ({err.strerror or err})") from None


def _refuse_overwriting_inputs(path: Path, flag: str, inputs: tuple) -> None:
    """An output path that is one of the command's inputs, or lies inside an input directory, is refused (exit 2):
    writing it would replace what the user gave (a --report onto the checkpoint's config.json)."""
    target = path.resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if target == source or (source.is_dir() and source in target.parents):
            raise UsageError(f"{flag} {path}: would overwrite the input {given}; write it somewhere else")


@cli.command("run", context_settings=CONTEXT)
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--prompt-ids", "prompt_ids", multiple=True,
              help="Prompt token ids, comma-separated, e.g. 1,2,3. Give it again for more prompts: they are served "
                   "together, one line (or JSON object) each, in order.")
@click.option("--prompt", "prompt_texts", multiple=True, metavar="TEXT",
              help="A text prompt, encoded with the checkpoint's tokenizer.json; the generated text is printed. "
                   "Give it again for more prompts (instead of --prompt-ids).")
@click.option("--chat", "chat_texts", multiple=True, metavar="TEXT",
              help="A user message, rendered with the checkpoint's chat template (as serve's chat API renders it); "
                   "the reply's text is printed. Give it again for more conversations (instead of --prompt).")
@click.option("--system", metavar="TEXT", help="With --chat: a system message opening each conversation.")
@click.option("--chat-template", "chat_template_path", type=click.Path(path_type=Path), metavar="FILE",
              help="With --chat: this Jinja chat template instead of the checkpoint's.")
@click.option("--max-new-tokens", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), help="Compute dtype (default: the checkpoint's).")
@click.option("--save-logits", type=click.Path(path_type=Path),
              help="Save the prompt's logits, float32 [T, vocab], as .npy (to exactly this path; one prompt only).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the config's eos_token_id: generate --max-new-tokens.")
@click.option("--memory-budget", metavar="SIZE", callback=_size_option,
              help="Stay within SIZE (e.g. 16GiB, 800MB): weights + caches + the largest step's temporaries + the "
                   "runtime. A checkpoint's KV pool is shrunk to fit when it can; otherwise refused (exit 2) before "
                   "the caches are allocated.")
@click.option("--json", "as_json", is_flag=True,
              help="Print a machine-readable JSON result per prompt (with finish_reason and where the memory went).")
@click.option("--mesh", "mesh_spec", metavar="SPEC",
              help="Lay the model out on a device mesh (8, 4x2, 2x4) with gqa-sharding; this host gets that many "
                   "CPU devices (simulated: they share its cores).")
@click.option("--temperature", default=0.0, show_default=True, type=float,
              help="Sample with this temperature (0: greedy), on the device.")
@click.option("--top-k", default=0, show_default=True, type=int, help="Sample from the k most likely tokens (0: all).")
@click.option("--top-p", default=1.0, show_default=True, type=float,
              help="Sample from the smallest set of tokens whose probability reaches P (1: all).")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Sampling seed; prompt i draws with seed + i, so a run is reproducible whatever the batch.")
@_penalty_options
@_cluster_options
def run_cmd(checkpoint, prompt_ids, prompt_texts, chat_texts, system, chat_template_path, max_new_tokens, dtype,
            save_logits, ignore_eos, memory_budget, as_json, mesh_spec, temperature, top_k, top_p, seed, min_p,
            presence_penalty, frequency_penalty, repetition_penalty, coordinator, num_processes, process_id,
            join_timeout):
    """Greedy-generate from CHECKPOINT (or a compiled artifact directory) and print the new token ids (the text,
    for --prompt and --chat).

    Generation stops after an EOS token (the config's eos_token_id; printed as the last token) or after
    --max-new-tokens; --ignore-eos always generates --max-new-tokens. Several --prompt-ids are generated together
    in one batch (prefill and decode steps shared), each printed on its own line in the order given.
    """
    import numpy as np

    from qcompile.ir.abi import CacheConfig
    from qcompile.runtime.model import load_model

    from qcompile.frontend.tokenizer import decode, load_tokenizer
    from qcompile.runtime.sampling import Sampling

    if sum(map(bool, (prompt_ids, prompt_texts, chat_texts))) != 1:
        raise UsageError("give the prompts as --prompt-ids 1,2,3, as --prompt TEXT or as --chat TEXT (one of the "
                         "three, repeatable)")
    if (system is not None or chat_template_path is not None) and not chat_texts:
        raise UsageError("--system and --chat-template go with --chat")
    tokenizer = None
    if chat_texts:
        from qcompile.frontend.chat import ChatError, encode_chat, load_chat_template

        tokenizer_dir = _tokenizer_dir(checkpoint)
        tokenizer = load_tokenizer(tokenizer_dir, "--chat")
        template = load_chat_template(tokenizer_dir, chat_template_path)
        if template is None:
            raise UsageError(f"--chat needs a chat template: {checkpoint} has none (chat_template.jinja, or "
                             "tokenizer_config.json's chat_template); give one with --chat-template FILE")
        opening = [{"role": "system", "content": system}] if system is not None else []
        try:
            prompts = [encode_chat(tokenizer, template, [*opening, {"role": "user", "content": text}])
                       for text in chat_texts]
        except ChatError as err:
            raise UsageError(f"--chat: {err}") from None
    elif prompt_texts:
        tokenizer = load_tokenizer(_tokenizer_dir(checkpoint), "--prompt")
        prompts = [tokenizer.encode(text).ids for text in prompt_texts]
        if not all(prompts):
            raise UsageError("--prompt is empty (it encodes to no tokens)")
    else:
        prompts = [_parse_ids(text) for text in prompt_ids]
    sampling = Sampling(temperature, top_k, top_p, seed, min_p=min_p, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty)  # refused (exit 2)
    # before anything loads
    if not sampling.argmax and save_logits is not None:
        raise UsageError("--save-logits saves a greedy run's prompt logits; drop --temperature and the penalties")
    cluster = _cluster(coordinator, num_processes, process_id, join_timeout)
    from qcompile.runtime.artifact import is_artifact, load_artifact
    from qcompile.runtime.memory import frozen_heap

    if cluster is not None and mesh_spec is None and not is_artifact(checkpoint):
        raise UsageError("several processes share a mesh: give --mesh (e.g. --mesh 2x4) or a laid-out artifact")
    mesh = _setup_mesh(mesh_spec, cluster)
    if save_logits is not None:
        if len(prompts) > 1:
            raise UsageError("--save-logits saves one prompt's logits; give one --prompt-ids with it")
        _check_output_file(save_logits, "--save-logits", (checkpoint,))  # before loading: never fail after generating
    longest = max(len(ids) for ids in prompts)
    started = time.perf_counter()
    if is_artifact(checkpoint):
        if dtype:
            raise UsageError("--dtype does not apply to an artifact: its dtype was fixed when it was compiled")
        if mesh is not None:
            raise UsageError("--mesh does not apply to an artifact: its layout was fixed when it was compiled")
        _artifact_devices(checkpoint, cluster)
        artifact = load_artifact(checkpoint)
        if artifact.weights_note:
            click.echo(artifact.weights_note, err=True)
        limit = artifact.cache_config
        if len(prompts) > limit.max_seqs:
            raise UsageError(f"{len(prompts)} prompts, but the artifact serves at most {limit.max_seqs} sequences "
                             "at once; recompile with a larger --max-seqs")
        if longest + max_new_tokens > limit.max_context:
            raise UsageError(f"prompt + new tokens ({longest + max_new_tokens}) exceed the artifact's max context "
                             f"{limit.max_context}; recompile with a larger --max-context")
        eos_ids = tuple(artifact.config_json.get("eos_token_ids") or ())
        engine, vocab = artifact.engine(memory_budget), int(artifact.config_json["vocab_size"])
        graph = artifact.graph() if as_json else None
        family, graph_dtype = artifact.config_json["family"], artifact.manifest.get("compute_dtype")
    else:
        rewrite, slots = None, len(prompts)
        if mesh is not None:  # laid out with gqa-sharding; whole sequence slots per data-parallel rank
            from qcompile.compiler.distribute import lay_out

            def rewrite(graph):  # before the host layout (column panels), as a compiled build is
                return lay_out(graph, mesh, concurrency=len(prompts), max_context=longest + max_new_tokens)

            slots = -(-slots // mesh.size) * mesh.size
        model = load_model(checkpoint, dtype, rewrite=rewrite)
        model.checkpoint.warn_unknown()
        model.checkpoint.warn_context(longest + max_new_tokens, "the longest prompt + --max-new-tokens")
        eos_ids = model.checkpoint.config.eos_token_ids
        vocab, family, graph_dtype = model.checkpoint.config.vocab_size, model.checkpoint.config.family, model.graph.meta["dtype"]
        engine = model.engine(CacheConfig(max_seqs=slots, max_context=longest + max_new_tokens,
                                          max_step_tokens=min(sum(len(ids) for ids in prompts), 256)),
                              memory_budget=memory_budget)
        graph = model.graph
        if engine.pool_note:
            click.echo(f"qcompile: {engine.pool_note}", err=True)
    bad = [i for ids in prompts for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"prompt id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    if ignore_eos:
        eos_ids = ()
    loaded = time.perf_counter()
    with frozen_heap():  # the loaded model's objects out of the garbage collector's walks (runtime/memory.py)
        if sampling.argmax:
            result = engine.generate(prompts, max_new_tokens, prompt_logits=save_logits is not None, eos_ids=eos_ids)
        else:
            result = _sample_prompts(engine, prompts, max_new_tokens, eos_ids, sampling)
    done = time.perf_counter()
    from qcompile.runtime.distributed import is_leader

    if not is_leader():  # every process generated the same tokens; process 0 reports them
        return
    if save_logits:
        try:
            with open(save_logits, "wb") as f:
                np.save(f, np.asarray(result["prompt_logits"][0], np.float32))
        except OSError as err:
            raise UsageError(f"--save-logits {save_logits}: cannot write it ({err.strerror or err})") from None
    memory = engine.memory(graph) if as_json else None
    for ids, tokens, finish_reason in zip(prompts, result["tokens"], result["finish_reasons"]):
        # a reply's text without its end-of-turn marker (the eos); a --prompt continuation shows every token
        text = decode(tokenizer, tokens, skip_special=bool(chat_texts)) if tokenizer is not None else None
        if as_json:
            extra = {"text": text} if text is not None else {}
            click.echo(json.dumps({"prompt_ids": ids, "tokens": tokens, **extra, "finish_reason": finish_reason,
                                   "eos_token_ids": list(eos_ids), "dtype": graph_dtype, "family": family,
                                   "seconds": {"load": round(loaded - started, 3), "generate": round(done - loaded, 3),
                                               "first_token": round(result["first_token_at"] - started, 3)},
                                   "memory": memory}))
        elif text is not None:
            click.echo(text.replace("\n", "\\n"))  # one line per prompt
        else:
            click.echo(",".join(str(t) for t in tokens))


def _tokenizer_dir(source: Path) -> Path:
    """Where the tokenizer of a checkpoint (beside config.json) or an artifact (runtime/artifact.py) is."""
    from qcompile.runtime.artifact import is_artifact, tokenizer_dir

    source = Path(source)
    if is_artifact(source):
        return tokenizer_dir(source)
    return source if source.is_dir() else source.parent

def _sample_prompts(engine, prompts, max_new_tokens, eos_ids, sampling) -> dict:
    """`run` with sampling: the prompts served by the continuous-batching scheduler, prompt i drawing with seed + i
    (its tokens are the same alone or together); the result in `Engine.generate`'s form."""
    import attrs

    from qcompile.runtime.scheduler import Request, Scheduler

    requests = [Request(ids, max_new_tokens, stop_ids=tuple(eos_ids), id=i,
                        sampling=attrs.evolve(sampling, seed=(sampling.seed + i) % 2**32))
                for i, ids in enumerate(prompts)]
    Scheduler(engine).run(requests)
    return {"tokens": [r.tokens for r in requests],
            "finish_reasons": ["eos" if r.finish_reason == "stop" else r.finish_reason for r in requests],
            "first_token_at": min(r.first_token_at for r in requests)}


@cli.command("init-tiny", context_settings=CONTEXT)
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--family", type=click.Choice(["qwen3_5_moe", "qwen3_next"]), default="qwen3_5_moe", show_default=True)
@click.option("--preset", type=click.Choice(["tiny", "bench", "qwen3.5-397b", "qwen3-next-80b"]), default="tiny",
              show_default=True,
              help="tiny: ~0.8M parameters; bench: 514M parameters in the Qwen3.5 3:1 pattern (docs/bench_preset.md); "
                   "qwen3.5-397b, qwen3-next-80b: the published full-size shapes (with --sparse).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--dtype", type=click.Choice(["f32", "bf16", "fp8"]), default=None,
              help="Weight dtype [default: f32; bf16 with --sparse]. fp8: Qwen's block-scaled FP8 (e4m3, 128x128 "
                   "blocks, a weight_scale_inv per projection; other tensors bf16).")
@click.option("--sparse", is_flag=True,
              help="Header-only sharded checkpoint: real safetensors headers, data as file holes that read as zeros "
                   "(full-size compile and memory tests without the disk space; not for numerics).")
@click.option("--force", is_flag=True, help="Write into DIRECTORY even if it is not empty (replacing a checkpoint's "
                                            "files there).")
def init_tiny_cmd(directory, family, preset, seed, dtype, sparse, force):
    """Write a random Hugging Face-format checkpoint (config.json + model.safetensors) into DIRECTORY."""
    from qcompile.frontend.tiny import full_config, write_sparse_checkpoint, write_tiny

    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory}: exists and is not a directory")
    if directory.is_dir() and not force and any(directory.iterdir()):
        held = "a checkpoint" if any((directory / name).exists() for name in
                                     ("config.json", "model.safetensors", "model.safetensors.index.json")) else "files"
        raise UsageError(f"{directory} is not empty (it holds {held}); pass --force to write the checkpoint into it "
                         "anyway, or give a new directory")
    if sparse:
        dtype = dtype or "bf16"
        if dtype == "fp8":
            raise UsageError("--sparse writes bf16 or f32 headers; FP8 checkpoints are written with their values")
        write_sparse_checkpoint(directory, full_config(preset, family, dtype), dtype=dtype)
        click.echo(f"wrote a sparse {family} ({preset}, {dtype}, zeros) to {directory}")
        return
    dtype = dtype or "f32"
    write_tiny(directory, family=family, preset=preset, seed=seed, dtype=dtype)
    click.echo(f"wrote {family} ({preset}, {dtype}, seed {seed}) to {directory}")


@cli.command("bench", context_settings=CONTEXT)
@click.argument("source", metavar="CHECKPOINT|ARTIFACT", type=click.Path(path_type=Path), required=False)
@click.option("--url", metavar="URL",
              help="Measure the server running at URL (qcompile serve; e.g. http://127.0.0.1:8000) instead of "
                   "CHECKPOINT: the same prompts, arrivals and metrics, through HTTP.")
@click.option("--workload", type=click.Choice(["prefill-heavy", "decode-heavy"]), default="decode-heavy",
              show_default=True, help="The field's 8K/1K (prefill-heavy) or 1K/8K (decode-heavy) shape, scaled by --scale.")
@click.option("--scale", default=64, show_default=True, metavar="N",
              help="Divide the workload's full-size lengths by N (this machine cannot hold 8K contexts at speed).")
@click.option("--input-len", type=int, metavar="N", help="Prompt length in tokens (overrides the workload).")
@click.option("--output-len", type=int, metavar="N", help="Generated tokens per request (overrides the workload).")
@click.option("--concurrency", default="1,8,32", show_default=True, metavar="C1,C2,...",
              help="Concurrent requests (one run per value).")
@click.option("--num-prompts", type=int, metavar="M", help="Requests per concurrency (default: one wave of C).")
@click.option("--request-rate", type=float, metavar="R",
              help="Requests arrive R per second (Poisson, seeded; inf: all at once) and are served by continuous "
                   "batching, at most C at a time, instead of in lock-step waves.")
@click.option("--n", "choices", default=1, show_default=True, metavar="N",
              help="With --request-rate: each prompt asks for N choices (sample them: --temperature), measured sharing "
                   "the prompt's prefill (as serve does for a request's n) and each fed on its own (with --url: one "
                   "request with the server's n).")
@click.option("--turns", default=1, show_default=True, metavar="K",
              help="With --request-rate: each prompt opens a conversation of K requests, each sent when the one "
                   "before finishes with its prompt, reply and new tokens; measured with serve's prefix cache and "
                   "without (with --url: the server as it runs).")
@click.option("--shared-prefix-len", "shared_prefix", default=0, show_default=True, metavar="P",
              help="With --request-rate: every prompt starts with the same P of its --input-len tokens (a system "
                   "prompt); measured with serve's prefix cache (which snapshots the shared prefix) and without (with "
                   "--url: the server as it runs).")
@click.option("--reasoning-len", "reasoning", default=0, show_default=True, metavar="R",
              help="With --turns: each reply's first R tokens are reasoning that the next turn's prompt leaves out, as "
                   "a thinking model's chat template (Qwen3.5's) drops earlier turns' thinking.")
@click.option("--prefix-slots", type=click.IntRange(min=0), metavar="N",
              help="With --turns or --shared-prefix-len: sequence slots beyond the concurrency that only the prefix "
                   "cache uses, as serve's --prefix-slots [default: 1 per data-parallel rank].")
@click.option("--passes", "passes_spec", default=None, metavar="SPEC", help="Passes of the build (default all).")
@click.option("--compare", multiple=True, type=click.Choice(["transformers"]),
              help="Also run Hugging Face transformers eager on the same checkpoint, prompts and threads.")
@click.option("--ablate", is_flag=True, help="Builds none, all, all minus each pass and none plus each pass.")
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), help="Compute dtype (default: the checkpoint's).")
@click.option("--max-step-tokens", default=512, show_default=True, help="Largest prefill chunk per step.")
@click.option("--verify", type=click.Choice(["final", "none"]), default="final", show_default=True,
              help="Check each build against the unoptimized graph before measuring it.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seed of the random prompts, the arrivals, and the sampling (request i draws with seed + i).")
@click.option("--temperature", default=0.0, show_default=True, type=float,
              help="Sample every request with this temperature (0: greedy), on both engines.")
@click.option("--top-k", default=0, show_default=True, type=int, help="With --temperature: keep the K most likely (0: off).")
@click.option("--top-p", default=1.0, show_default=True, type=float,
              help="With --temperature: keep the most likely tokens up to probability P (1: off).")
@_penalty_options
@click.option("--memory-budget", metavar="SIZE", callback=_size_option,
              help="Refuse (exit 2) a concurrency whose weights + caches + temporaries + runtime exceed SIZE.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the results (docs/benchmarks.md schema).")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG bar chart (needs matplotlib).")
@click.option("--mesh", "mesh_spec", metavar="SPEC",
              help="Lay the model out on a device mesh (8, 4x2, 2x4) with gqa-sharding; this host gets that many "
                   "CPU devices (simulated: they share its cores).")
@_cluster_options
def bench_cmd(source, url, workload, scale, input_len, output_len, concurrency, num_prompts, request_rate, choices, turns,
              shared_prefix, reasoning, prefix_slots, passes_spec, compare, ablate, dtype, max_step_tokens, verify,
              seed, temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty,
              memory_budget, json_path, plot_path, mesh_spec, coordinator, num_processes, process_id, join_timeout):
    """Measure prefill/decode throughput, latency and % of roofline of CHECKPOINT (or an artifact), or of a running
    server with --url."""
    from qcompile.compiler.bench import BenchOptions, run_bench
    from qcompile.runtime.sampling import Sampling

    if (source is None) == (url is None):
        raise UsageError("give a CHECKPOINT (or artifact) to measure in this process, or --url of a running server")
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None:
            _check_output_file(path, flag, (source,))
    sampling = Sampling(temperature, top_k, top_p, seed % 2**32, min_p=min_p, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty)  # refused (exit
    # 2) before anything loads

    try:
        levels = tuple(int(part) for part in concurrency.split(","))
    except ValueError:
        raise UsageError(f"--concurrency must be comma-separated integers, got {concurrency!r}") from None
    cluster = _cluster(coordinator, num_processes, process_id, join_timeout)
    if url is not None and (cluster is not None or mesh_spec is not None):
        raise UsageError("--coordinator and --mesh do not apply to --url: the server's layout is fixed")
    if cluster is not None:
        from qcompile.runtime.artifact import is_artifact

        if mesh_spec is None and not is_artifact(source):
            raise UsageError("several processes share a mesh: give --mesh (e.g. --mesh 2x4) or a laid-out artifact")
        if compare:
            raise UsageError("--compare runs transformers in one process; drop it with --coordinator")
    mesh = _setup_mesh(mesh_spec, cluster)
    if mesh is None and source is not None:
        _artifact_devices(source, cluster)
    from qcompile.runtime.distributed import is_leader

    leader = is_leader()  # every process measures the same run; process 0 reports it
    if not leader:
        json_path = plot_path = None
    opts = BenchOptions(source=source, workload=workload, input_len=input_len, output_len=output_len, scale=scale,
                        concurrency=levels, num_prompts=num_prompts, passes=passes_spec, compare=tuple(compare),
                        ablate=ablate, json_path=json_path, plot_path=plot_path, seed=seed, dtype=dtype,
                        max_step_tokens=max_step_tokens, verify=verify, memory_budget=memory_budget,
                        request_rate=request_rate, mesh=mesh, url=url, sampling=sampling, n=choices, turns=turns,
                        shared_prefix=shared_prefix, reasoning=reasoning, prefix_slots=prefix_slots)
    run_bench(opts, emit=click.echo if leader else lambda *args, **kwargs: None)


def _artifact_request_slots(slots: int, prefix_slots: int, ranks: int) -> int:
    """The slots of an artifact's engine that requests may take when `prefix_slots` of them are the prefix cache's
    (serve --prefix-slots); a usage error when that leaves none, or a number the ranks cannot split."""
    requests = slots - prefix_slots
    if requests < 1 or requests % ranks:
        raise UsageError(f"--prefix-slots {prefix_slots} must leave a positive multiple of the artifact's {ranks} "
                         f"data-parallel rank{'s' * (ranks != 1)} of its {slots} slots for requests")
    return requests


@cli.command("serve", context_settings=CONTEXT)
@click.argument("source", metavar="CHECKPOINT|ARTIFACT", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free port; the one taken is printed).")
@click.option("--served-model-name", metavar="NAME", help="The model's name in the API [default: SOURCE's name].")
@click.option("--passes", "passes_spec", default=None, metavar="SPEC",
              help="Passes of the served build (checkpoint only) [default: all], checked before serving.")
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), help="Compute dtype (checkpoint only).")
@click.option("--max-seqs", type=click.IntRange(min=1), metavar="N",
              help="Requests served at once (sequence slots; checkpoint only) [default: 8].")
@click.option("--max-context", type=click.IntRange(min=2), metavar="N",
              help="Longest prompt + max_tokens of a request (checkpoint only) [default: 2048].")
@click.option("--num-pages", type=click.IntRange(min=1), metavar="N",
              help="KV pages in the pool (checkpoint only) [default: enough for every slot at --max-context]; fewer "
                   "pages serve more sequences of mixed length, preempting when they run out.")
@click.option("--max-step-tokens", type=click.IntRange(min=1), metavar="N",
              help="Tokens per engine step (decode tokens + prefill chunks; checkpoint only) [default: 256].")
@click.option("--memory-budget", metavar="SIZE", callback=_size_option,
              help="Memory to stay within: without --num-pages the KV pool is sized to fit it (preempting when "
                   "pages run out); refused (exit 2) when not even one --max-context sequence fits.")
@click.option("--verify", type=click.Choice(["final", "none"]), default="final", show_default=True,
              help="Check the build against the unoptimized graph before serving (checkpoint only).")
@click.option("--no-warmup", is_flag=True, help="Compile each shape bucket on first use instead of before serving.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Keep finished sequences (slot and KV pages, released whenever a request needs them) so that a "
                   "prompt continuing one — the next turn of a conversation — feeds only its new tokens, and "
                   "snapshots of the prefixes prompts share (a system prompt) that later prompts start from.")
@click.option("--prefix-slots", type=click.IntRange(min=0), metavar="N",
              help="Sequence slots beyond --max-seqs that only the prefix cache uses, so its snapshots (a shared "
                   "prefix's; a thinking conversation's last prompt end: give about the conversations active at once) "
                   "survive a full batch (each holds one sequence's GDN state) [default: 1 with the prefix cache, "
                   "rounded up to a multiple of the data-parallel ranks; an artifact: 0, and N are taken out of its "
                   "slots].")
@click.option("--mesh", "mesh_spec", metavar="SPEC",
              help="Lay the model out on a device mesh (8, 4x2) with gqa-sharding (checkpoint only).")
@click.option("--chat-template", "chat_template_path", type=click.Path(path_type=Path), metavar="FILE",
              help="A Jinja chat template for /v1/chat/completions [default: the tokenizer's chat_template.jinja, "
                   "else tokenizer_config.json's chat_template].")
@click.option("--reasoning-parser", type=click.Choice(["think", "qwen3", "deepseek_r1"]),
              help="Return a chat reply's <think> ... </think> block as message.reasoning_content (delta."
                   "reasoning_content when streamed), apart from its content (thinking models: Qwen3, Qwen3.5, "
                   "Qwen3-Next-Thinking; qwen3 and deepseek_r1, the names vLLM's commands use, are the same parser).")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="Accepted for vLLM's command line: tool_choice \"auto\" is on whenever --tool-call-parser is given.")
@click.option("--tool-call-parser", type=click.Choice(["hermes", "qwen3_coder"]),
              help="Accept chat requests' tools (rendered by the chat template) and return the reply's calls as "
                   "message.tool_calls: hermes reads <tool_call>{JSON}</tool_call> (Qwen3, Qwen3-Next), qwen3_coder "
                   "<tool_call><function=NAME><parameter=K>...</tool_call> (Qwen3.5, Qwen3-Coder).")
@click.option("--generation-config", "generation_config", type=click.Choice(["auto", "none"]), default="auto",
              show_default=True,
              help="auto: a request that leaves out temperature, top_p, top_k, min_p or repetition_penalty gets the "
                   "value the model's generation_config.json sets (as vLLM does; Qwen3.5's sets its recommended "
                   "sampling); none: OpenAI's defaults (temperature 1, no filter).")
def serve_cmd(source, host, port, served_model_name, passes_spec, dtype, max_seqs, max_context, num_pages,
              max_step_tokens, memory_budget, verify, no_warmup, prefix_cache, prefix_slots, mesh_spec, chat_template_path,
              reasoning_parser, enable_auto_tool_choice, tool_call_parser, generation_config):
    """Serve CHECKPOINT (or an artifact) over HTTP with OpenAI's completions and chat APIs (docs/serving.md).

    \b
    POST /v1/completions   prompt as text or token ids; max_tokens, temperature, top_p, top_k, min_p, seed, n,
                           presence_penalty, frequency_penalty, repetition_penalty, logit_bias, stop,
                           stop_token_ids, ignore_eos, stream (server-sent events), logprobs, echo; choices carry
                           token_ids
    POST /v1/chat/completions
                           messages rendered with the model's chat template; the same options, and
                           max_completion_tokens, chat_template_kwargs (e.g. {"enable_thinking": false}),
                           logprobs and top_logprobs, tools (with --tool-call-parser)
    GET  /v1/models        the served model, its max_model_len and vocab_size
    GET  /health           200 while the engine runs, 503 when it has stopped
    GET  /metrics          Prometheus: running/waiting requests, KV pages, tokens/s, TTFT and ITL histograms

    Requests are served together by continuous batching (runtime/scheduler.py). Ctrl-C stops the server.
    """
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(f"qcompile serve needs the serve extra ({err.name} is missing): "
                         "pip install 'qcompile[serve]'") from None
    from qcompile.ir.abi import CacheConfig
    from qcompile.runtime.artifact import is_artifact, load_artifact
    from qcompile.runtime.scheduler import Scheduler
    from qcompile.runtime.server import Metrics, ModelInfo, bind, create_app, uvicorn_server
    from qcompile.runtime.memory import frozen_heap
    from qcompile.runtime.serving import EngineLoop

    artifact = is_artifact(source)
    if prefix_slots and not prefix_cache:
        raise UsageError("--prefix-slots are the prefix cache's: drop --no-prefix-cache, or --prefix-slots")
    if artifact:
        given = [flag for flag, value in (("--passes", passes_spec), ("--dtype", dtype), ("--max-seqs", max_seqs),
                                          ("--max-context", max_context), ("--num-pages", num_pages),
                                          ("--max-step-tokens", max_step_tokens), ("--mesh", mesh_spec))
                 if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} do not apply to an artifact: its build and cache sizes were fixed "
                             "when it was compiled")
    elif not Path(source).exists():
        raise CheckpointError(f"{source}: no such file or directory")
    from qcompile.frontend.chat import load_chat_template

    tokenizer_dir = _tokenizer_dir(source)
    chat_template = load_chat_template(tokenizer_dir, chat_template_path)  # a bad template fails before loading
    mesh = _setup_mesh(mesh_spec)
    sock = bind(host, port)  # before loading: a taken port fails in a second, not after minutes
    try:
        if artifact:
            _artifact_devices(source)
            art = load_artifact(source)
            if art.weights_note:
                click.echo(art.weights_note, err=True)
            engine = art.engine(memory_budget)
            eos_ids, vocab = tuple(art.config_json.get("eos_token_ids") or ()), int(art.config_json["vocab_size"])
            generation = dict(art.config_json.get("generation_defaults") or ())
            requests = _artifact_request_slots(engine.cache_cfg.max_seqs, prefix_slots or 0, engine.ranks)
        else:
            from qcompile.compiler.builds import builds_from_checkpoint

            slots = max_seqs or 8
            if mesh is not None and slots % mesh.size:  # as compile and run do (compiler/driver.py)
                padded = -(-slots // mesh.size) * mesh.size
                click.echo(f"qcompile: note: --max-seqs {slots} rounded up to {padded}, a multiple of the "
                           f"{mesh.size} devices, so every data-parallel rank gets whole sequence slots", err=True)
                slots, num_pages = padded, num_pages and -(-num_pages // mesh.size) * mesh.size
            ranks = mesh.size if mesh is not None else 1
            extra = (1 if prefix_cache else 0) if prefix_slots is None else prefix_slots
            requests, extra = slots, -(-extra // ranks) * ranks  # every rank keeps as many
            cache = CacheConfig(max_seqs=slots + extra, max_context=max_context or 2048, num_pages=num_pages,
                                max_step_tokens=max_step_tokens or 256)
            ckpt, _, builds, target = builds_from_checkpoint(
                source, [passes_spec if passes_spec is not None else "all"], dtype=dtype, mesh=mesh, verify=verify,
                options=(("concurrency", requests), ("max_context", cache.max_context)),
                emit=lambda line: click.echo(line, err=True),
                progress=lambda line: click.echo(f"qcompile: {line}", err=True))
            ckpt.warn_unknown()
            ckpt.warn_context(cache.max_context, "--max-context")
            from qcompile.runtime.engine import Engine

            engine = Engine(builds[0].graph, builds[0].params, cache, target, memory_budget)
            eos_ids, vocab = tuple(ckpt.config.eos_token_ids), ckpt.config.vocab_size
            generation = dict(ckpt.config.generation_defaults)
        if engine.pool_note:
            click.echo(f"qcompile: {engine.pool_note}", err=True)
        tokenizer = None
        if (tokenizer_dir / "tokenizer.json").is_file():
            from qcompile.frontend.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer_dir, "serve")
        else:
            click.echo(f"qcompile: no tokenizer.json beside {source}: prompts must be token ids, and choices carry "
                       "token_ids with empty text", err=True)
        if tokenizer is not None and chat_template is None:
            click.echo(f"qcompile: no chat template beside {source} (chat_template.jinja, or tokenizer_config.json's "
                       "chat_template): /v1/chat/completions answers 400; --chat-template FILE gives one", err=True)
        if not no_warmup:
            click.echo("qcompile: compiling the step's shape buckets before serving (--no-warmup skips this)",
                       err=True)
            # sampled requests too (an artifact's sampled steps use its all-token buckets, exported ready)
            engine.compile_all_buckets(sampling=not artifact or art.program.samples)
        name = served_model_name or Path(source).resolve().name
        info = ModelInfo(name=name, vocab_size=vocab, max_context=engine.cache_cfg.max_context, eos_ids=eos_ids,
                         defaults=_request_defaults(generation if generation_config == "auto" else {}))
        metrics = Metrics()
        loop = EngineLoop(Scheduler(engine, prefix_cache=prefix_cache, max_running=requests), metrics.on_state)
        metrics.on_state(loop.state())
        loop.start()
        app = create_app(loop, info, tokenizer, metrics, chat_template, reasoning_parser, tool_call_parser)
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        kept = engine.cache_cfg.max_seqs - requests
        click.echo(f"qcompile: serving {name} on http://{shown}:{bound[1]} ({requests} sequences "
                   f"x {engine.cache_cfg.max_context} tokens, {engine.sizes['P']} KV pages of {engine.page_size}"
                   f"{f', {kept} prefix-cache slot' + 's' * (kept != 1) if kept else ''}); Ctrl-C stops", err=True)
        try:
            with frozen_heap():  # the loaded model's objects out of the garbage collector's walks (runtime/memory.py)
                uvicorn_server(app, sock, on_exit=loop.request_stop).run(sockets=[sock])
        finally:
            loop.stop()
    finally:
        sock.close()


def _request_defaults(generation: dict) -> dict:
    """generation_config.json's sampling fields that a request may take as its defaults, each said on stderr (and each
    out of a request's range, with why it is left out)."""
    from qcompile.runtime.requests import request_defaults

    defaults, refused = request_defaults(generation)
    if defaults:
        shown = ", ".join(f"{field} {value:g}" for field, value in defaults.items())
        click.echo(f"qcompile: requests that leave them out sample with generation_config.json's {shown} "
                   "(--generation-config none: OpenAI's defaults)", err=True)
    if refused:
        click.echo(f"qcompile: warning: generation_config.json's {', '.join(refused)} left out: outside what a "
                   "request may ask for", err=True)
    return defaults


@cli.command("check", context_settings=CONTEXT)
@click.argument("source", metavar="ARTIFACT|CHECKPOINT", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_path", required=True, type=click.Path(path_type=Path), metavar="FILE",
              help='JSON lines: {"prompt_ids": [...]}, {"prompt": "..."} (needs the checkpoint\'s tokenizer.json) '
                   'or {"messages": [...]} (rendered with its chat template).')
@click.option("--reference", type=click.Path(path_type=Path), metavar="CHECKPOINT",
              help="The unoptimized model (required for an artifact; default: the checkpoint itself).")
@click.option("--passes", "passes_spec", default=None, metavar="SPEC",
              help="Passes of the candidate when SOURCE is a checkpoint (default: all); refused for an artifact, "
                   "which carries its own.")
@click.option("--max-new-tokens", default=32, show_default=True, help="Steps compared per prompt.")
@click.option("--min-agreement", default=0.99, show_default=True,
              help="Exit 3 when the overall top-1 agreement is below this.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the per-prompt report as JSON.")
def check_cmd(source, prompts_path, reference, passes_spec, max_new_tokens, min_agreement, json_path):
    """Compare an optimized model with its unoptimized reference on your prompts: per prompt and overall top-1
    agreement, KL(reference ‖ optimized) and the first step where greedy tokens diverge, teacher-forced over
    --max-new-tokens decode steps."""
    from qcompile.compiler.check import CheckOptions, run_check

    if json_path is not None:
        _check_output_file(json_path, "--json", (source, prompts_path, reference))
    _artifact_devices(source)
    run_check(CheckOptions(source=source, prompts=prompts_path, reference=reference, passes=passes_spec,
                           max_new_tokens=max_new_tokens, min_agreement=min_agreement, json_path=json_path),
              emit=click.echo)


@cli.command("plan", context_settings=CONTEXT)
@click.argument("source", metavar="CONFIG|CHECKPOINT", type=click.Path(path_type=Path))
@click.option("--target", default="tpu7x", show_default=True, type=click.Choice(["tpu7x", "h200", "cpu"]),
              help="Hardware description (ir/hardware.py; cpu: this machine, its ceilings measured now).")
@click.option("--chips", type=click.IntRange(min=1), metavar="N",
              help="Chips (default: one host: 4 TPU7x chips = 8 devices, 8 H200s, 1 CPU).")
@click.option("--concurrency", default="64", show_default=True, metavar="C1,C2,...",
              help="Concurrent sequences to plan for.")
@click.option("--input-len", type=click.IntRange(min=1), metavar="N",
              help="Prompt tokens per request (with --output-len: one custom workload instead of prefill-heavy "
                   "8K/1K and decode-heavy 1K/8K).")
@click.option("--output-len", type=click.IntRange(min=1), metavar="N", help="Generated tokens per request.")
@click.option("--passes", "passes_spec", default="all", show_default=True, metavar="SPEC",
              help="The build to plan; `none` and each single-pass ablation of it are planned beside it.")
@click.option("--no-ablate", is_flag=True, help="Plan only `none` and --passes.")
@click.option("--mesh", "mesh_spec", metavar="SPEC",
              help="Arrange the devices as this mesh (default: chips x devices per chip, e.g. 4x2 for TPU7x); "
                   "tensor parallelism runs over its innermost axes.")
@click.option("--no-lower", is_flag=True,
              help="Skip exporting the planned decode step for the target's platform (jax.export from abstract "
                   "shapes: its Mosaic kernels and collectives; ~20 s for the 397B model).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), metavar="FILE", help="Write the plan as JSON.")
def plan_cmd(source, target, chips, concurrency, input_len, output_len, passes_spec, no_ablate, mesh_spec,
             no_lower, json_path):
    """Plan a deployment from the config alone: per device, weights by kind, KV pages and GDN state slots at each
    concurrency, activation peak, whether it fits and how many sequences could; per step, collective bytes; predicted
    tok/s per chip for prefill-heavy and decode-heavy work at the target's published ceilings — for `none`, --passes
    and each single-pass ablation. Nothing is read but config.json (or a checkpoint's headers)."""
    from qcompile.compiler.plan import PlanOptions, run_plan
    from qcompile.ir.abi import MAX_CONTEXT, MAX_SEQS
    from qcompile.passes.registry import parse_spec

    try:
        levels = tuple(int(part) for part in concurrency.split(","))
    except ValueError:
        raise UsageError(f"--concurrency must be comma-separated integers, got {concurrency!r}") from None
    if any(level < 1 for level in levels):
        raise UsageError(f"--concurrency levels must be positive, got {concurrency!r}")
    if max(levels) > MAX_SEQS:  # the plan walks every sequence's pages: memory grows with the level
        raise UsageError(f"--concurrency {max(levels)} is more than qcompile plans ({MAX_SEQS})")
    for flag, value in (("--input-len", input_len), ("--output-len", output_len)):  # click checks >= 1
        if value is not None and value > MAX_CONTEXT:
            raise UsageError(f"{flag} must be in 1..{MAX_CONTEXT}, got {value}")
    parse_spec(passes_spec)
    if json_path is not None:
        _check_output_file(json_path, "--json", (source,))
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or directory")
    run_plan(PlanOptions(source=source, target=target, chips=chips, concurrency=levels, input_len=input_len,
                         output_len=output_len, passes=passes_spec, ablate=not no_ablate, json=json_path,
                         mesh=mesh_spec, lower=not no_lower),
             emit=click.echo)


def _out_of_memory(err: BaseException) -> bool:
    """An allocation the machine could not satisfy: Python's MemoryError, or XLA's RESOURCE_EXHAUSTED."""
    return isinstance(err, MemoryError) or (type(err).__name__ == "JaxRuntimeError"
                                            and "RESOURCE_EXHAUSTED" in str(err))


def _oom_detail(err: BaseException) -> str:
    text = str(err).split("\n")[0]
    return text.split("RESOURCE_EXHAUSTED:", 1)[-1].strip()[:160] or type(err).__name__


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="qcompile", standalone_mode=False)
    except click.exceptions.Exit as exit_:
        sys.exit(exit_.exit_code)
    except click.exceptions.Abort:
        click.echo("qcompile: aborted", err=True)
        sys.exit(1)
    except click.ClickException as err:  # one line, as every other error (not click's usage block)
        hint = ""
        if isinstance(err, click.UsageError) and err.ctx is not None:
            hint = f" (see: {err.ctx.command_path} --help)"
        click.echo(f"qcompile: error: {one_line(err.format_message())}{hint}", err=True)
        sys.exit(err.exit_code)
    except QCompileError as err:
        click.echo(f"qcompile: error: {one_line(err)}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("qcompile: interrupted", err=True)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, exit 1
        if _out_of_memory(err):
            click.echo(f"qcompile: error: out of memory ({one_line(_oom_detail(err))}); ask for less — a shorter "
                       "--max-context or --max-new-tokens, fewer --max-seqs or a smaller --concurrency — or set "
                       "--memory-budget to have the sizes checked before anything runs", err=True)
            sys.exit(2)
        if os.environ.get("QCOMPILE_DEBUG"):
            traceback.print_exc()
        click.echo(f"qcompile: internal error: {one_line(f'{type(err).__name__}: {err}')} "
                   "(set QCOMPILE_DEBUG=1 for the traceback)", err=True)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
