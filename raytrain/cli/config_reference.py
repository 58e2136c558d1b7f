"""The reference of `raytrain fit`'s TOML format, generated from the config dataclasses, so it cannot drift:

    python -m raytrain.cli.config_reference > docs/config.md

Every `[section]` is one dataclass of `raytrain.config` (`SECTIONS`); each key is one of its fields, with the type
and default read from the dataclass and the meaning from its docstring's `Attributes:` block. `[entry]` names the
Python builders (`ENTRY_KEYS`, `OPTIONAL_ENTRY_KEYS`). `tests/test_cli_fit.py` checks that docs/config.md is this
module's output.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from raytrain.cli.fit_config import ENTRY_KEYS, SECTIONS

ENTRY_DOC = {
    "model": "`() -> torch.nn.Module`: builds the model (in every worker; see the init contract in README).",
    "loss": "`(model, batch) -> Tensor[n]`: one loss per sample of the batch (a dict of column tensors).",
    "optimizer": "`(params, lr)` or `(model, lr) -> torch.optim.Optimizer` (first parameter named `model`: the "
    "module).",
    "datasets": '`() -> {"train": ..., "val"?: ...}`: Parquet paths or URIs, `ParquetSource`s or Ray datasets '
    "(called on the driver, after Ray is up).",
    "lr_schedule": "optional `(step, total_steps) -> factor` of the peak LR (replaces warmup and schedule).",
    "tp_plan": 'optional `(model) -> {module pattern: "colwise" | "rowwise"}`, for `[parallel] tp` > 1.',
    "init_key_map": "optional `(name in the files) -> model name | None`, for `init_from` weights saved under other "
    "names.",
    "init_from": "optional string: pretrained weights, a safetensors file or a Hugging Face model directory "
    "(relative to the TOML file) or a URI such as `s3://bucket/model`.",
    "init_missing": 'optional string, `"init"` (default) or `"error"`: a tensor of the model that `init_from` lacks '
    "(a new head) keeps the model's own init, listed in one line, or is refused.",
    "init_unexpected": 'optional string, `"error"` (default) or `"ignore"`: a tensor of `init_from` the model lacks '
    "(an LM head under a classifier) is refused naming it, or left out in one line.",
    "required_columns": "optional list of strings: the columns `loss` reads, checked before any worker starts.",
}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its description, from the class docstring's `Attributes:` block (continuation lines
    joined)."""
    doc = inspect.getdoc(cls) or ""
    block = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    docs: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current and line.startswith("        "):
            docs[current] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            current = None
    return docs


def _default(field: dataclasses.Field[object]) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`".replace("'", '"') if field.default is not None else "none"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return "**required**"


def reference() -> str:
    """docs/config.md: every table and key of the TOML format."""
    out = [
        "# `raytrain fit` configuration reference",
        "",
        "Generated from `raytrain.config` by `python -m raytrain.cli.config_reference` (do not edit by hand; a",
        "test checks it). Run a file with `raytrain fit FILE.toml`; command-line flags (`--steps`, `--workers`, ...)",
        "override its values. An unknown table or key is an error naming it and the valid ones. Example:",
        "`examples/fit_mlp.toml`; a project of two files: `examples/char_project/job.toml`.",
        "",
        "## `[entry]`",
        "",
        'Python builders as `"module:function"` or `"path/file.py:function"` (a path relative to the TOML file; the',
        "file's directory is importable, so it may import its neighbours). Required: "
        + ", ".join(f"`{k}`" for k in ENTRY_KEYS)
        + ".",
        "",
        "| key | meaning |",
        "|---|---|",
    ]
    out += [f"| `{key}` | {text.replace('|', chr(92) + '|')} |" for key, text in ENTRY_DOC.items()]
    for table, cls in SECTIONS.items():
        summary = (inspect.getdoc(cls) or "").split("\n\n", 1)[0].replace("\n", " ")
        out += ["", f"## `[{table}]` — `raytrain.config.{cls.__name__}`", "", summary, ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        docs = field_docs(cls)
        for field in dataclasses.fields(cls):
            text = docs.get(field.name, "").replace("|", "\\|")
            kind = str(field.type).replace("|", "or")
            out.append(f"| `{field.name}` | `{kind}` | {_default(field)} | {text} |")
    return "\n".join(out) + "\n"


def main() -> None:
    print(reference(), end="")


if __name__ == "__main__":
    main()
