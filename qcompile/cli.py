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
from qcompile.errors import QCompileError, UsageError, one_line

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


class DefaultGroup(click.Group):
    """A group that runs `compile` when the first argument is not a command name."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help", "--version"):
            args = ["compile", *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="qcompile")
def cli():
    """qcompile: compile Qwen3.5-MoE / Qwen3-Next checkpoints into checked JAX executables.

    \b
    qcompile [compile] [--passes SPEC] [-o OUT] CHECKPOINT   build, optimize, check and export the step graph
    qcompile run CHECKPOINT|OUT --prompt-ids 1,2,3           greedy generation (checkpoint or artifact)
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
@click.option("--page-size", default=16, show_default=True, help="KV cache page length in tokens (power of two).")
@click.option("--target", type=click.Choice(["cpu", "gpu", "tpu"]), default="cpu", show_default=True,
              help="Platform the artifact is exported for (tpu and gpu artifacts can be built here, not run).")
@click.option("--verify", type=click.Choice(["each", "final", "none"]), default="each", show_default=True,
              help="Numerics checks: after each pass and at the end, only at the end, or none.")
@click.option("--verify-layers", type=int, metavar="N",
              help="Check numerics on a slice of N real layers of each type (for models too large to run whole).")
@click.option("--seed", default=0, show_default=True, help="Seed of the numerics check inputs.")
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
def compile_cmd(checkpoint, passes_spec, output, report_path, dtype, page_size, target, verify, verify_layers, seed,
                print_ir_after, print_ir_after_change, dump_dir, repro_dir, max_seqs, max_context, max_step_tokens):
    """Load CHECKPOINT, build and verify the step graph, run and check the selected passes, write the artifact."""
    from qcompile.compiler.driver import CompileOptions, compile_checkpoint
    from qcompile.ir.abi import CacheConfig

    opts = CompileOptions(
        checkpoint=checkpoint, passes=passes_spec, output=output, report=report_path, dtype=dtype,
        page_size=page_size, target=target, verify=verify, verify_layers=verify_layers, seed=seed,
        print_ir_after=tuple(print_ir_after), print_ir_after_change=print_ir_after_change, dump_dir=dump_dir,
        repro_dir=repro_dir,
        cache=CacheConfig(max_seqs=max_seqs, max_context=max_context, max_step_tokens=max_step_tokens))
    report = compile_checkpoint(opts, emit=click.echo)
    click.echo(f"done in {report['compile_seconds']:.1f}s")


@cli.command("passes", context_settings=CONTEXT)
def passes_cmd():
    """List every registered pass: name, summary, whether `all` selects it, tolerance class, requirements."""
    from qcompile.passes.registry import PASSES

    if not PASSES:
        click.echo("no passes are registered yet; --passes accepts all and none")
        return
    click.echo(f"{'pass':<26} {'in all':<7} {'tolerance':<14} {'requires':<24} summary")
    for p in PASSES.values():
        requires = ", ".join(p.requires) or "-"
        click.echo(f"{p.name:<26} {'yes' if p.in_all else 'no':<7} {p.tolerance:<14} {requires:<24} {p.summary}")


@cli.command("reproduce", context_settings=CONTEXT)
@click.argument("directory", type=click.Path(path_type=Path))
def reproduce_cmd(directory):
    """Re-run a numerics failure from the reproducer DIRECTORY a failed compile wrote."""
    from qcompile.compiler.reproduce import reproduce

    ok, line = reproduce(directory)
    click.echo(line)
    if not ok:
        from qcompile.errors import NumericsError

        raise NumericsError(f"still failing: {line}")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids


@cli.command("run", context_settings=CONTEXT)
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--prompt-ids", required=True, help="Prompt token ids, comma-separated, e.g. 1,2,3.")
@click.option("--max-new-tokens", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), help="Compute dtype (default: the checkpoint's).")
@click.option("--save-logits", type=click.Path(path_type=Path), help="Save the prompt's logits, float32 [T, vocab], as .npy.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON result.")
def run_cmd(checkpoint, prompt_ids, max_new_tokens, dtype, save_logits, as_json):
    """Greedy-generate from CHECKPOINT (or a compiled artifact directory) and print the new token ids."""
    import numpy as np

    from qcompile.ir.abi import CacheConfig
    from qcompile.runtime.model import load_model

    ids = _parse_ids(prompt_ids)
    started = time.perf_counter()
    from qcompile.runtime.artifact import is_artifact, load_artifact

    if is_artifact(checkpoint):
        if dtype:
            raise UsageError("--dtype does not apply to an artifact: its dtype was fixed when it was compiled")
        artifact = load_artifact(checkpoint)
        engine, vocab = artifact.engine(), int(artifact.config_json["vocab_size"])
        family, graph_dtype = artifact.config_json["family"], artifact.manifest.get("compute_dtype")
        limit = engine.cache_cfg.max_context
        if len(ids) + max_new_tokens > limit:
            raise UsageError(f"prompt + new tokens ({len(ids) + max_new_tokens}) exceed the artifact's max context "
                             f"{limit}; recompile with a larger --max-context")
    else:
        model = load_model(checkpoint, dtype)
        model.checkpoint.warn_unknown()
        vocab, family, graph_dtype = model.checkpoint.config.vocab_size, model.checkpoint.config.family, model.graph.meta["dtype"]
        engine = model.engine(CacheConfig(max_seqs=1, max_context=len(ids) + max_new_tokens))
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"prompt id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    loaded = time.perf_counter()
    result = engine.generate([ids], max_new_tokens, prompt_logits=save_logits is not None)
    done = time.perf_counter()
    tokens = result["tokens"][0]
    if save_logits:
        np.save(save_logits, np.asarray(result["prompt_logits"][0], np.float32))
    if as_json:
        click.echo(json.dumps({"prompt_ids": ids, "tokens": tokens, "dtype": graph_dtype, "family": family,
                               "seconds": {"load": round(loaded - started, 3), "generate": round(done - loaded, 3)}}))
    else:
        click.echo(",".join(str(t) for t in tokens))


@cli.command("init-tiny", context_settings=CONTEXT)
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--family", type=click.Choice(["qwen3_5_moe", "qwen3_next"]), default="qwen3_5_moe", show_default=True)
@click.option("--preset", type=click.Choice(["tiny", "bench"]), default="tiny", show_default=True,
              help="tiny: ~0.8M parameters; bench: 514M parameters in the Qwen3.5 3:1 pattern (docs/bench_preset.md).")
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), default="f32", show_default=True)
@click.option("--force", is_flag=True, help="Overwrite an existing checkpoint in DIRECTORY.")
def init_tiny_cmd(directory, family, preset, seed, dtype, force):
    """Write a random Hugging Face-format checkpoint (config.json + model.safetensors) into DIRECTORY."""
    from qcompile.frontend.tiny import write_tiny

    if (directory / "model.safetensors").exists() and not force:
        raise UsageError(f"{directory} already holds a checkpoint; pass --force to overwrite it")
    write_tiny(directory, family=family, preset=preset, seed=seed, dtype=dtype)
    click.echo(f"wrote {family} ({preset}, {dtype}, seed {seed}) to {directory}")


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="qcompile", standalone_mode=False)
    except click.exceptions.Exit as exit_:
        sys.exit(exit_.exit_code)
    except click.exceptions.Abort:
        click.echo("qcompile: aborted", err=True)
        sys.exit(1)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except QCompileError as err:
        click.echo(f"qcompile: error: {one_line(err)}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("qcompile: interrupted", err=True)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, exit 1
        if os.environ.get("QCOMPILE_DEBUG"):
            traceback.print_exc()
        click.echo(f"qcompile: internal error: {one_line(f'{type(err).__name__}: {err}')} "
                   "(set QCOMPILE_DEBUG=1 for the traceback)", err=True)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
