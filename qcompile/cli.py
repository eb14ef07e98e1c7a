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
    qcompile [compile] [--passes SPEC] [-o OUT] CHECKPOINT   build, verify and report the step graph
    qcompile run CHECKPOINT --prompt-ids 1,2,3               greedy generation
    qcompile init-tiny DIR --family qwen3_5_moe              write a random HF-format checkpoint

    CHECKPOINT is a directory with config.json, a model.safetensors file with config.json beside it, or a
    model.safetensors.index.json. Exit codes: 0 ok, 1 internal error, 2 usage, 3 numerics check failed,
    4 IR verification failed, 65 bad input.
    """


@cli.command("compile", context_settings=CONTEXT)
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--passes", "passes_spec", default="all", show_default=True, metavar="SPEC",
              help="Passes to run: all, none, a,b or all,-a (left to right, last mention wins).")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write graph.qir and report.json here.")
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), help="Compute dtype (default: the checkpoint's).")
@click.option("--page-size", default=16, show_default=True, help="KV cache page length in tokens (power of two).")
@click.option("--target", type=click.Choice(["cpu", "gpu", "tpu"]), default="cpu", show_default=True,
              help="Backend the executable is for (only cpu runs on this build so far).")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Also write the JSON report here.")
def compile_cmd(checkpoint, passes_spec, output, dtype, page_size, target, report_path):
    """Load CHECKPOINT, build and verify the step graph, run the selected passes, write the results."""
    from qcompile.frontend.checkpoint import Checkpoint
    from qcompile.ir.printer import print_graph
    from qcompile.passes.registry import parse_spec
    from qcompile.runtime.model import build_graph, summarize

    started = time.perf_counter()
    selected = parse_spec(passes_spec)
    if target != "cpu":
        raise UsageError(f"--target {target} is not available yet; this build compiles for cpu only")
    ckpt = Checkpoint.open(checkpoint)
    ckpt.warn_unknown()
    graph = build_graph(ckpt, dtype, page_size)
    report = {"qcompile_version": __version__, "checkpoint": str(checkpoint), "target": target,
              "passes": {"spec": passes_spec, "selected": selected, "results": []}, **summarize(ckpt, graph)}
    report["compile_seconds"] = round(time.perf_counter() - started, 3)
    text = json.dumps(report, indent=2) + "\n"
    if output:
        output.mkdir(parents=True, exist_ok=True)
        (output / "graph.qir").write_text(print_graph(graph))
        (output / "report.json").write_text(text)
    if report_path:
        report_path.write_text(text)
    layers = report["layers"]
    params = report["parameters"]
    click.echo(
        f"{report['family']}: {layers['total']} layers ({layers['linear_attention']} GDN, {layers['full_attention']}"
        f" attention), {params['total'] / 1e6:.2f}M parameters ({params['active_per_token'] / 1e6:.2f}M active per"
        f" token), graph of {len(graph)} ops verified"
    )
    click.echo(f"passes: {', '.join(selected) if selected else 'none selected (no passes are registered yet)'}")
    if output:
        click.echo(f"wrote {output / 'graph.qir'} and {output / 'report.json'}")


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
    """Greedy-generate from CHECKPOINT with the unoptimized graph and print the new token ids."""
    import numpy as np

    from qcompile.runtime.engine import CacheConfig
    from qcompile.runtime.model import load_model

    ids = _parse_ids(prompt_ids)
    started = time.perf_counter()
    model = load_model(checkpoint, dtype)
    model.checkpoint.warn_unknown()
    vocab = model.checkpoint.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"prompt id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    loaded = time.perf_counter()
    context = len(ids) + max_new_tokens
    engine = model.engine(CacheConfig(max_seqs=1, max_context=context))
    result = engine.generate([ids], max_new_tokens, prompt_logits=save_logits is not None)
    done = time.perf_counter()
    tokens = result["tokens"][0]
    if save_logits:
        np.save(save_logits, np.asarray(result["prompt_logits"][0], np.float32))
    if as_json:
        click.echo(json.dumps({"prompt_ids": ids, "tokens": tokens, "dtype": model.graph.meta["dtype"],
                               "family": model.checkpoint.config.family,
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
