"""The trained model, out (`raytrain.model_export`): a checkpoint written by any layout exports to the same safetensors
files, which transformers loads as its own model; `load_model` gives the user's model back in one process.

A tied Llama (transformers, tiny) is built once by the sharded build and checkpointed by raytrain's own
`save_checkpoint` at ddp W = 1, zero3 W = 2, tensor parallel 2 and pipeline parallel 2 (gloo), each rank's files
merged into a run directory as Ray Train merges them. Then, in this process:
- the four exports are tensor for tensor the same, equal the model's weights, and hold the tie once;
- `LlamaForCausalLM.from_pretrained` loads an export with no missing or unexpected key, and its logits equal those
  of the model raytrain checkpointed; bf16 and sharded (index file) exports load too;
- a damaged newest checkpoint is skipped with a line, `--step` picks one, and every bad input is one line.
The round trip through training (pretrained file -> fine-tune on Ray -> export -> transformers): test_pretrained.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from user_models import llama

from raytrain.errors import ConfigError
from raytrain.model_export import choose_checkpoint, export, iter_tensors, load_model
from raytrain.testing.multiprocess import run_world

LAYOUTS = {"zero3-w2": {"strategy": "zero3"}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}  # at W = 2; plus ddp at W = 1
TP_PLAN = {
    **{f"model.layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"},
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def _save(rank: int, world: int, layout: dict[str, Any]) -> str:
    """The tied Llama, built and laid out as the worker loop does, checkpointed by `save_checkpoint`."""
    from raytrain.checkpoint import TrainState, save_checkpoint
    from raytrain.data.id_ranges import IdRanges
    from raytrain.model_init import record_build
    from raytrain.model_record import model_record
    from raytrain.optim import build_optimizer
    from raytrain.parallel.apply import apply_parallelism
    from raytrain.parallel.dims import ParallelDims
    from raytrain.parallel.tensor import resolve_plan

    dims = ParallelDims.of(world, tp=layout.get("tp", 1), pp=layout.get("pp", 1))
    mesh = dims.build_mesh("cpu") if dims.model_parallel else None
    coords = dims.coords(rank)
    built = record_build(llama)
    record = model_record(built.model)
    plan = resolve_plan(built.model, TP_PLAN, dims.tp) if dims.tp > 1 else None
    strategy = str(layout.get("strategy", "ddp"))
    model = apply_parallelism(
        built.model, strategy, torch.device("cpu"), dims, mesh=mesh, tp_plan=plan, stage=coords.pp, init=built.trace
    )
    optimizer = build_optimizer(model, lambda params, lr: torch.optim.AdamW(params, lr=lr), 1e-3, strategy)
    state = TrainState(step=1, model=record)
    return save_checkpoint(model, optimizer, state, rank, IdRanges(), flat_optimizer=dims.pp > 1)


def _world_main(rank: int, world: int) -> dict[str, str]:
    return {name: _save(rank, world, layout) for name, layout in LAYOUTS.items()}


def _into_run(run: Path, directories: list[str], step: int = 1) -> Path:
    """The ranks' directories merged into `run/checkpoint_<step>` (as Ray Train merges them)."""
    target = run / f"checkpoint_2026-12-07_00-00-{step:02d}"
    target.mkdir(parents=True)
    for directory in directories:
        for name in os.listdir(directory):
            shutil.copy(os.path.join(directory, name), target / name)
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Run directories, one per layout, each with the step-1 checkpoint."""
    import torch.distributed as dist

    root = tmp_path_factory.mktemp("export-runs")
    out = {"ddp-w1": root / "ddp-w1"}
    _into_run(out["ddp-w1"], [_save(0, 1, {})])
    assert not dist.is_initialized()
    per_rank = run_world(_world_main, 2, preload=("torch", "raytrain.worker_loop", "transformers"))
    for name in LAYOUTS:
        out[name] = root / name
        _into_run(out[name], [rank[name] for rank in per_rank])
    return out


def _exported(run: Path, tmp: Path, **options: Any) -> dict[str, torch.Tensor]:
    target = tmp / f"{run.name}-{len(list(tmp.iterdir()))}"
    export(str(run), str(target), **options)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_every_layout_exports_the_same_model(runs: dict[str, Path], tmp_path: Path) -> None:
    """ddp W = 1, zero3 W = 2, tp 2 and pp 2 (whose stages each hold their own tensors, the tie on both): one
    export, equal to the model's weights (the sharded build is the same at every layout), the tie once."""
    from raytrain.model_init import materialize, record_build

    built = record_build(llama)
    materialize(built.model, "cpu", built.trace, 0)
    expected = {name: t.detach() for name, t in built.model.state_dict().items() if name != "lm_head.weight"}
    first = _exported(runs["ddp-w1"], tmp_path)
    assert sorted(first) == sorted(expected) and "lm_head.weight" not in first  # save_pretrained's choice
    for name, value in expected.items():
        assert torch.equal(first[name], value), name
    for layout in LAYOUTS:
        other = _exported(runs[layout], tmp_path)
        assert sorted(other) == sorted(first), layout
        for name, value in first.items():
            assert torch.equal(other[name], value), f"{name} differs in the export of {layout}"


def test_transformers_loads_the_export_as_its_own_model(runs: dict[str, Path], tmp_path: Path) -> None:
    """`from_pretrained` on the export: no missing or unexpected key, the tie restored, the same logits as the
    model raytrain checkpointed (via `load_model`, the user's model in one process); a bf16 export sharded into
    several files with an index loads as bf16 and matches within bf16's precision."""
    import transformers

    target = tmp_path / "hf"
    result = export(str(runs["zero3-w2"]), str(target))
    assert result.files == ["model.safetensors", "config.json", "generation_config.json"] and result.step == 1
    model, info = transformers.LlamaForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ours = load_model(str(runs["tp2"]), llama)
    assert not ours.training
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, ours(input_ids=tokens).logits)
    half = tmp_path / "hf-bf16"
    written = export(str(runs["pp2"]), str(half), dtype="bf16", max_shard_size="15KB")
    assert "model.safetensors.index.json" in written.files and len(written.files) > 4
    index = json.loads((half / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == written.nbytes and len(set(index["weight_map"].values())) > 2
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    small = transformers.AutoModelForCausalLM.from_pretrained(half)
    assert small.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.allclose(small(input_ids=tokens).logits.float(), model(input_ids=tokens).logits, atol=0.1)


def test_the_newest_intact_checkpoint_and_bad_input(runs: dict[str, Path], tmp_path: Path) -> None:
    """A newer checkpoint cut short is skipped with one line (as a resume skips it); --step chooses; an output
    directory in use, a step that does not exist, a damaged chosen step, a run without checkpoints and a model_fn
    that is not the run's are each one line naming what to change."""
    run = tmp_path / "run"
    shutil.copytree(runs["ddp-w1"], run)
    newer = run / "checkpoint_2026-12-07_00-00-02"
    shutil.copytree(next(run.iterdir()), newer)
    state = json.loads((newer / "raytrain_state.json").read_text())
    (newer / "raytrain_state.json").write_text(json.dumps({**state, "step": 2}))
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["files"]["raytrain_state.json"] = (newer / "raytrain_state.json").stat().st_size
    (newer / "manifest.json").write_text(json.dumps(manifest))
    assert choose_checkpoint(str(run)).step == 2
    shard = next(newer.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut short: the manifest tells
    lines: list[str] = []
    result = export(str(run), str(tmp_path / "out"), log=lines.append)
    assert result.step == 1
    assert lines[0].startswith("WARNING: checkpoint checkpoint_2026-12-07_00-00-02 is damaged (__0_0.distcp has 100 ")
    with pytest.raises(ConfigError, match=r"output directory '.*out' is not empty \(config.json, .*--overwrite"):
        export(str(run), str(tmp_path / "out"))
    (tmp_path / "out" / "tokenizer.json").write_text("{}")  # not the export's: left in place
    export(str(run), str(tmp_path / "out"), overwrite=True, step=1)
    assert (tmp_path / "out" / "tokenizer.json").exists()
    with pytest.raises(ConfigError, match=r"has no checkpoint at step 7; its steps: \[1, 2\]"):
        export(str(run), str(tmp_path / "other"), step=7)
    with pytest.raises(ConfigError, match=r"the checkpoint at step 2 \(.*\) is damaged: __0_0.distcp has 100 of"):
        export(str(run), str(tmp_path / "other"), step=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no committed checkpoint"):
        export(str(tmp_path / "empty"), str(tmp_path / "other"))
    with pytest.raises(ConfigError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\]"):
        export(str(run), str(tmp_path / "other"), dtype="int8")
    with pytest.raises(ConfigError, match=r"max_shard_size must be a size such as 5GB"):
        export(str(run), str(tmp_path / "other"), max_shard_size="big")
    with pytest.raises(ConfigError, match=r"has no tensor 'model.layers.2.self_attn.q_proj.weight' of model_fn"):
        load_model(str(run), lambda: llama(layers=3))
    with pytest.raises(ConfigError, match=r"holds \d+ tensor\(s\) model_fn's model does not have, e.g. 'model.layer"):
        load_model(str(run), lambda: llama(layers=1))
    assert dict(iter_tensors(str(run), step=1)).keys() >= {"lm_head.weight", "model.embed_tokens.weight"}


def test_the_command_line_export(runs: dict[str, Path], tmp_path: Path) -> None:
    """`raytrain export RUN_DIR OUT_DIR --json` as a user types it; a bad input is one line and exit 2."""
    command = [sys.executable, "-m", "raytrain.cli.main", "export", str(runs["ddp-w1"])]
    done = subprocess.run([*command, str(tmp_path / "cli"), "--json"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["step"] == 1 and summary["files"][0] == "model.safetensors"
    assert "[raytrain] exported step 1 (checkpoint_2026-12-07_00-00-01): " in done.stderr
    again = subprocess.run([*command, str(tmp_path / "cli")], capture_output=True, text=True, check=False)
    assert again.returncode == 2 and again.stderr.startswith("raytrain: error: output directory")
    assert len(again.stderr.strip().splitlines()) == 1
