"""`raytrain export`: a run's trained model as safetensors (`raytrain.model_export`).

raytrain export RUN_DIR OUT_DIR [--step N] [--dtype bf16|fp16|fp32] [--max-shard-size 5GB] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from raytrain.console import say


def add_export_parser(subparsers: Any) -> None:
    """The `export` subcommand's arguments (registered by `raytrain.cli.main`)."""
    p = subparsers.add_parser(
        "export",
        help="write a run's trained model as safetensors (and a transformers config) for use outside raytrain",
        description="Write the model of a run's checkpoint (the newest intact one, or --step) to OUT_DIR as "
        "safetensors under the model's own names, a tied parameter once, sharded above --max-shard-size with an "
        "index file; for a transformers model also config.json, so AutoModel*.from_pretrained(OUT_DIR) loads it. "
        "Any strategy and layout, either recovery mode, the user's own loop; local or object storage.",
        epilog="examples:\n"
        "  raytrain export raytrain_runs/mlp exported/\n"
        "  raytrain export s3://bucket/runs/gpt2-cls exported/ --dtype bf16 --step 200\n"
        '  python -c "from transformers import AutoModelForSequenceClassification as A; '
        "A.from_pretrained('exported/')\"",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source",
        metavar="RUN_DIR",
        help="the run's checkpoint directory (<storage_path>/<run_name>), "
        "a path or a URI such as s3://bucket/runs/name",
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="a local directory, empty or absent (see --overwrite)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint at this step (default: the newest intact)")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="floating-point tensors in this dtype (default: as stored, fp32)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest file before sharding (default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace the model files in a non-empty OUT_DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object with what was written")
    p.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Run `raytrain export` (exit 0; a `ConfigError` becomes the one-line error of `raytrain.cli.main`)."""
    from raytrain.model_export import export

    result = export(
        args.source,
        args.out_dir,
        step=args.step,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        log=lambda line: say(line),
    )
    if args.json:
        print(
            json.dumps(
                {
                    "step": result.step,
                    "checkpoint": result.checkpoint,
                    "out_dir": result.out_dir,
                    "files": result.files,
                    "tensors": result.tensors,
                    "bytes": result.nbytes,
                }
            )
        )
    return 0
