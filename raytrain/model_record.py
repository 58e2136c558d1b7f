"""What every checkpoint records about the model, so that `raytrain export` needs nothing but the run directory.

Computed once per worker-group start from the model as `model_fn` built it (before any parallelism), stored in
each checkpoint's `raytrain_state.json` under "model" (`TrainState.model`), in every recovery mode and in the
user's own loop:

    class            the model's class, "module.QualName"
    ties             each tied parameter's names (`raytrain.model_tensors.tie_groups`): written once on export
    leave_out        the names of a tie the export leaves out, as `save_pretrained` does (transformers'
                     `_tied_weights_keys`: `lm_head.weight` under `transformer.wte.weight`); else all but the first
    transformers     for a transformers `PreTrainedModel`: its `config` and `generation_config` as JSON objects,
                     written beside the weights so `AutoModel*.from_pretrained(OUT_DIR)` loads the export
"""

from __future__ import annotations

import json
import sys
from typing import Any

from torch import nn

from raytrain.model_tensors import tie_groups

FORMAT = 1


def model_record(model: nn.Module) -> dict[str, Any]:
    """The record of `model` (module docstring); `model` may be on the meta device. JSON-serialisable."""
    groups = tie_groups(model)
    named_away = _transformers_tied_names(model)
    leave_out = []
    for group in groups:
        kept = next((name for name in group if name not in named_away), group[0])
        leave_out += [name for name in group if name != kept]
    record: dict[str, Any] = {
        "format": FORMAT,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "ties": groups,
        "leave_out": leave_out,
    }
    transformers = sys.modules.get("transformers")  # never imported here: a model of its classes imported it
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        config = json.loads(model.config.to_json_string(use_diff=False))
        config["architectures"] = [type(model).__name__]
        generation = getattr(model, "generation_config", None)
        record["transformers"] = {
            "config": config,
            "generation_config": json.loads(generation.to_json_string(use_diff=True)) if generation else None,
        }
    return record


def _transformers_tied_names(model: nn.Module) -> set[str]:
    """The names transformers' `save_pretrained` leaves out of a tie (its `_tied_weights_keys`: a list of names in
    transformers 4, a {tied name: source name} dict in 5), over the whole model (a head's prefix included)."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None)
        if isinstance(keys, dict):
            keys = list(keys)
        if isinstance(keys, list | tuple):
            names.update(f"{prefix}.{key}" if prefix else str(key) for key in keys)
    return names
