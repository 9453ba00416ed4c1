"""``kvport eval quality --codec NAME [--tokens N] [--windows W] [--param K=V] [--json PATH]``: codec
quality on the reference model, printed as JSON (provenance, conditions, baseline perplexity, per-codec
figures). A result file feeds ``kvport calibrate --quality PATH`` (the planner's codec quality costs)."""

from __future__ import annotations

import json

import click

from kvport.cli._params import writable_file
from kvport.cli._run import parse_key_values
from kvport.errors import CodecError, UserInputError


@click.group(name="eval")
def eval_group() -> None:
    """Quality evaluation of KV codecs on the reference model."""


@eval_group.command()
@click.option("--codec", "codec_names", multiple=True, required=True, help="codec id (repeatable)")
@click.option("--tokens", default=1024, show_default=True, type=click.IntRange(2, 8192), help="tokens per window")
@click.option("--windows", default=4, show_default=True, type=click.IntRange(1, 64), help="windows per text set")
@click.option("--sets", default="code,prose", show_default=True, help="text sets, comma separated")
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE", help="codec parameter (repeatable)")
@click.option("--kv-dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"]),
              help="dtype the codec sees (fp32: the codec's error alone; bf16: plus the cache's rounding)")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="also write the report here")
def quality(codec_names: tuple[str, ...], tokens: int, windows: int, sets: str, params: tuple[str, ...],
            kv_dtype: str, json_path: str | None) -> None:
    """Perplexity, top-1 agreement and KL of CODEC against the unquantized model."""
    from pathlib import Path

    from kvport.codec import get_codec
    from kvport.config import Settings
    from kvport.eval import QualityOptions, evaluate, provenance
    from kvport.eval.texts import TEXT_SETS
    from kvport.refmodel import MODEL_ID, load
    from kvport.spec import DType

    chosen = tuple(s.strip() for s in sets.split(",") if s.strip())
    bad = [s for s in chosen if s not in TEXT_SETS]
    if bad or not chosen:
        raise UserInputError(f"unknown text sets {bad}: expected some of {', '.join(TEXT_SETS)}")
    kw = parse_key_values(params, "--param")
    if json_path:
        writable_file(json_path, "--json")  # now, not after the evaluation
    try:
        codecs = [get_codec(name, **kw) for name in codec_names]
    except CodecError as exc:  # a codec name or parameter typed by a person
        raise UserInputError(str(exc)) from exc
    model, tok = load(Settings.from_env().model_dir)
    opts = QualityOptions(tokens=tokens, windows=windows, sets=chosen, kv_dtype=DType.parse(kv_dtype))
    report = evaluate(model, tok, codecs, opts, model_id=MODEL_ID)
    argv = [a for c in codec_names for a in ("--codec", c)]
    argv += ["--tokens", str(tokens), "--windows", str(windows), "--sets", ",".join(chosen)]
    argv += [a for p in params for a in ("--param", p)] + ["--kv-dtype", kv_dtype]
    text = json.dumps({"provenance": provenance(["eval", "quality", *argv])} | report.as_dict(), indent=2)
    click.echo(text)  # printed first: a failed write below does not lose the run
    if json_path:
        try:
            Path(json_path).write_text(text + "\n")
        except OSError as exc:
            raise UserInputError(f"--json {json_path}: cannot write the report: {exc.strerror or exc}") from exc
