"""Pretrained weights (`raytrain.pretrained`): a tiny transformers model written by `save_pretrained` is loaded as
the model's initial weights.

- The driver's check names a missing, unexpected or reshaped tensor and the files' problems; `init_key_map`
  renames; one name of a tied parameter is enough (save_pretrained stores a tie once). A new head on a pretrained
  model (a classifier from an LM file) keeps its own init, listed; the LM head the classifier lacks is refused, or
  left out on request; a base model's file matches a model with a head through transformers' prefix.
- Loaded through `apply_parallelism` at ddp W = 1, zero3 W = 2 and tensor parallel 2 (Llama's attention and MLP
  split), with the sharded build and with the full build, the weights equal the file bit for bit, and a zero3 rank
  reads about half the bytes.
- Through Ray, `ElasticTrainer(init_from=...)` at zero3 W = 2: step 1's loss equals transformers' own forward of
  the same samples in one process (`test_the_first_step_trains_the_pretrained_model`).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from user_models import gpt2, gpt2_classifier, llama

from raytrain.errors import ConfigError
from raytrain.model_init import record_build
from raytrain.parallel.apply import apply_parallelism
from raytrain.pretrained import check_names, open_pretrained
from raytrain.testing.multiprocess import run_world

LLAMA_TP_PLAN = {
    **{f"model.layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"},
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


@functools.cache
def saved(kind: str) -> Path:
    """A tiny model written by transformers' save_pretrained (random weights, seed 1), once per process."""
    import tempfile

    torch.manual_seed(1)
    builders = {"gpt2": gpt2, "llama": llama, "llama-shards": llama, "llama-untied": functools.partial(llama, False)}
    model = builders[kind]() if kind != "gpt2-base" else gpt2().transformer  # GPT2Model: names without the prefix
    directory = Path(tempfile.mkdtemp(prefix=f"raytrain-pretrained-{kind}-"))
    model.save_pretrained(directory, max_shard_size="20KB" if kind == "llama-shards" else "5GB")
    return directory


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_the_driver_checks_the_names_against_the_model(tmp_path: Path) -> None:
    model = record_build(gpt2).model
    assert "lm_head.weight" not in file_tensors(saved("gpt2"))  # the tie is stored once
    (line,) = check_names(open_pretrained(str(saved("gpt2"))), model)
    assert line.startswith(f"weights from {saved('gpt2')}: ") and "tensors" in line
    shards = open_pretrained(str(saved("llama-shards")))  # model.safetensors.index.json and its shards
    assert len({entry.file for entry in shards.entries.values()}) > 1
    check_names(shards, record_build(llama).model)
    single = saved("gpt2") / "model.safetensors"
    check_names(open_pretrained(str(single)), model)  # a file, not a directory

    from safetensors.torch import save_file

    renamed = tmp_path / "renamed.safetensors"  # as another trainer might have saved it
    save_file({"gpt." + name: value for name, value in file_tensors(saved("gpt2")).items()}, renamed)
    with pytest.raises(
        ConfigError, match=r"has no tensor 'transformer.wte.weight' of the model \(28 tensors missing; not"
    ):
        check_names(open_pretrained(str(renamed)), model)
    check_names(open_pretrained(str(renamed), key_map=lambda name: name.removeprefix("gpt.")), model)
    with pytest.raises(
        ConfigError, match=r"holds 12 tensors the model does not have, e.g. 'transformer.h.1.*init_unex"
    ):
        check_names(open_pretrained(str(saved("gpt2"))), record_build(functools.partial(_gpt2_layers, 1)).model)
    wider = functools.partial(_gpt2_layers, 2, 48)
    with pytest.raises(
        ConfigError, match=r"tensor 'transformer.wte.weight' has shape \[64, 32\] in the files, \[64, 48\]"
    ):
        check_names(open_pretrained(str(saved("gpt2"))), record_build(wider).model)


def test_a_new_head_on_a_pretrained_model_keeps_its_own_init() -> None:
    """The most common fine-tune: a classifier on a pretrained LM. The head the LM file lacks keeps the model's own
    init, listed in one line (or is refused with init_missing='error'); an LM head the classifier lacks is refused
    naming it, or left out with init_unexpected='ignore'; a base model's file (GPT2Model: no 'transformer.'
    prefix) matches a model with a head."""
    import transformers

    classifier = record_build(gpt2_classifier).model
    lines = check_names(open_pretrained(str(saved("gpt2"))), classifier)
    assert lines[1] == "init_from: 1 tensor not in the files keeps the model's own init: score.weight"
    with pytest.raises(ConfigError, match=r"has no tensor 'score.weight' of the model \(1 tensor missing; init_miss"):
        check_names(open_pretrained(str(saved("gpt2"))), classifier, missing="error")

    def llama_classifier() -> nn.Module:
        config = llama(tie=False).config
        config.num_labels, config.pad_token_id = 3, 0
        return transformers.LlamaForSequenceClassification(config)

    untied = str(saved("llama-untied"))  # holds lm_head.weight, which a classifier lacks
    with pytest.raises(
        ConfigError, match=r"holds 1 tensor the model does not have, e.g. 'lm_head.weight': pass init_u"
    ):
        check_names(open_pretrained(untied), record_build(llama_classifier).model)
    pretrained = open_pretrained(untied)
    lines = check_names(pretrained, record_build(llama_classifier).model, unexpected="ignore")
    assert lines[-1] == "init_from: 1 tensor of the files left out (init_unexpected='ignore'): lm_head.weight"
    assert "lm_head.weight" not in pretrained.entries  # never read
    base = open_pretrained(str(saved("gpt2-base")))
    assert "h.0.attn.c_attn.weight" in base.entries
    lines = check_names(base, classifier)
    assert lines[0] == (
        "init_from: the files' names lack the model's prefix 'transformer' ('h.0.attn.c_attn.bias'): matched with it"
    )
    assert "transformer.h.0.attn.c_attn.weight" in base.entries
    with pytest.raises(ConfigError, match=r"init_missing must be one of \('init', 'error'\), got 'zero'"):
        check_names(base, classifier, missing="zero")


def test_the_new_head_options_are_checked_where_a_user_sets_them(tmp_path: Path) -> None:
    """`init_missing` / `init_unexpected` in the Python API and in a TOML file: a value outside the choices is one
    error naming the field and the valid values, before anything is read; in TOML they need an init_from."""
    from raytrain.cli.fit_config import parse_fit_config
    from raytrain.config import BatchConfig, LRConfig
    from raytrain.toy import mlp, sgd, squared_error
    from raytrain.trainer import ElasticTrainer

    common: dict[str, object] = {
        "model_fn": mlp,
        "loss_fn": squared_error,
        "optimizer_fn": sgd,
        "datasets": {"train": str(tmp_path)},
        "batch": BatchConfig(global_batch=8, micro_batch=4),
        "lr": LRConfig(base_lr=0.1),
    }
    with pytest.raises(ConfigError, match=r"init_missing must be one of \('init', 'error'\), got 'zeros'"):
        ElasticTrainer(**common, init_from=str(saved("gpt2")), init_missing="zeros")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"init_unexpected must be one of \('error', 'ignore'\), got 'skip'"):
        ElasticTrainer(**common, init_from=str(saved("gpt2")), init_unexpected="skip")  # type: ignore[arg-type]
    entry = (
        '[entry]\nmodel = "raytrain.toy:mlp"\nloss = "raytrain.toy:squared_error"\noptimizer = "raytrain.toy:sgd"\n'
        'datasets = "raytrain.toy:regression_dataset"\n'
    )
    tables = "[batch]\nglobal_batch = 8\nmicro_batch = 4\n[lr]\nbase_lr = 0.1\n"
    path = tmp_path / "job.toml"
    path.write_text(entry + 'init_from = "weights/"\ninit_unexpected = "ignore"\n' + tables)
    job = parse_fit_config(str(path))
    assert (job.init_missing, job.init_unexpected, job.init_from) == ("init", "ignore", f"{tmp_path}/weights/")
    path.write_text(entry + 'init_from = "weights/"\ninit_missing = "zeros"\n' + tables)
    with pytest.raises(ConfigError, match=r"\[entry\] init_missing must be one of \['init', 'error'\], got 'zeros'"):
        parse_fit_config(str(path))
    path.write_text(entry + 'init_missing = "error"\n' + tables)
    with pytest.raises(ConfigError, match=r"\[entry\] init_missing applies to init_from weights; the file sets no"):
        parse_fit_config(str(path))


def _gpt2_layers(layers: int, width: int = 32) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def test_what_cannot_be_loaded_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"init_from '.*nowhere' does not exist"):
        open_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match=r"holds neither model.safetensors nor model.safetensors.index.json \(found "):
        open_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigError, match=r"model.safetensors is not a safetensors file"):
        open_pretrained(str(tmp_path))


CASES = {  # name -> (world, strategy, tp, model kind, sharded build)
    "ddp-w1": (1, "ddp", 1, "gpt2", True),
    "zero3-w2": (2, "zero3", 1, "gpt2", True),
    "zero3-w2-full-build": (2, "zero3", 1, "gpt2", False),
    "tp2": (2, "ddp", 2, "llama", True),
    "pp2": (2, "ddp", 1, "gpt2", True),  # two pipeline stages, each reading its own tensors (the tie on both)
    "classifier-w1": (1, "ddp", 1, "gpt2-classifier", True),  # a new head on the LM file: the model's own init
    "classifier-zero3-w2": (2, "zero3", 1, "gpt2-classifier", True),
}
BUILDERS = {"gpt2": gpt2, "llama": llama, "gpt2-classifier": gpt2_classifier}
FILES = {"gpt2": "gpt2", "llama": "llama", "gpt2-classifier": "gpt2"}  # model kind -> the file it starts from


def _load(rank: int, world: int, case: str, directory: str) -> dict[str, object]:
    from raytrain.parallel.dims import ParallelDims
    from raytrain.parallel.tensor import resolve_plan

    _, strategy, tp, kind, sharded = CASES[case]
    pretrained = open_pretrained(directory)
    builder = BUILDERS[kind]
    dims = ParallelDims.of(world, tp=tp, pp=2 if case == "pp2" else 1)
    mesh = dims.build_mesh("cpu") if dims.model_parallel else None
    if sharded:
        built = record_build(builder)
        model, trace = built.model, built.trace
    else:
        torch.manual_seed(5)
        model, trace = builder(), None
    plan = resolve_plan(model, LLAMA_TP_PLAN, tp) if tp > 1 else None
    stage = dims.coords(rank).pp
    model = apply_parallelism(
        model,
        strategy,
        torch.device("cpu"),
        dims,
        mesh=mesh,
        tp_plan=plan,
        stage=stage,
        init=trace,
        pretrained=pretrained,
    )
    model = getattr(model, "module", model)
    state = {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
        for name, t in model.state_dict().items()
    }
    return {"state": state, "bytes_read": pretrained.bytes_read, "total": pretrained.nbytes}


def _world_main(rank: int, world: int, dirs: dict[str, str]) -> dict[str, dict[str, object]]:
    return {case: _load(rank, world, case, dirs[FILES[spec[3]]]) for case, spec in CASES.items() if spec[0] == world}


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[dict[str, object]]]:
    dirs = {kind: str(saved(kind)) for kind in ("gpt2", "llama")}  # the files every rank reads
    results = {case: [_load(0, 1, case, dirs[FILES[kind]])] for case, (w, _, _, kind, _) in CASES.items() if w == 1}
    for rank in run_world(_world_main, 2, dirs, preload=("torch", "raytrain.worker_loop", "transformers")):
        for case, result in rank.items():
            results.setdefault(case, []).append(result)
    return results


@pytest.mark.parametrize("case", [case for case, spec in CASES.items() if "classifier" not in spec[3]])
def test_loaded_weights_equal_the_file_bit_for_bit(loaded: dict[str, list[dict[str, object]]], case: str) -> None:
    kind = CASES[case][3]
    expected = file_tensors(saved(kind))
    states = [rank["state"] for rank in loaded[case]]
    if case == "pp2":  # each stage holds its own tensors: together they are the model
        assert len(states[0]) < len(expected)
        states = [{name: t for state in states for name, t in state.items()}]  # type: ignore[attr-defined]
    for state in states:
        assert isinstance(state, dict)
        for name, value in expected.items():
            assert torch.equal(state[name], value), f"{name} differs from the file ({case})"
        assert torch.equal(state["lm_head.weight"], expected[next(n for n in expected if "embed" in n or "wte" in n)])


def test_a_new_head_is_the_same_at_every_world_size(loaded: dict[str, list[dict[str, object]]]) -> None:
    """The classifier started from the LM file: its trunk equals the file bit for bit, and its new head (the
    model's own init, replayed from the recording) is the same at W = 1 and at zero3 W = 2 on every rank."""
    expected = file_tensors(saved("gpt2"))
    head = loaded["classifier-w1"][0]["state"]["score.weight"]  # type: ignore[index]
    assert head.shape == (3, 32) and 0 < float(head.std()) < 1  # type: ignore[attr-defined]
    for rank in [*loaded["classifier-w1"], *loaded["classifier-zero3-w2"]]:
        state = rank["state"]
        assert isinstance(state, dict)
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
        assert torch.equal(state["score.weight"], head)


def test_a_zero3_rank_reads_its_shard_not_the_model(loaded: dict[str, list[dict[str, object]]]) -> None:
    for rank in loaded["zero3-w2"]:
        fraction = int(rank["bytes_read"]) / int(rank["total"])  # type: ignore[call-overload]
        assert 0.4 < fraction < 0.6, fraction  # each rank its half of every tensor's rows
    ddp = loaded["ddp-w1"][0]
    assert ddp["bytes_read"] == ddp["total"]


# ---------------------------------------------------------------- through Ray


ray = pytest.importorskip("ray")


def _ce_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sequence mean next-token cross entropy of a transformers causal LM."""
    logits = model(input_ids=batch["x"]).logits
    losses = nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
    return losses.view(batch["y"].shape).mean(dim=1)


@pytest.mark.ray
def test_pretrained_llama_fine_tuned_at_tp2_exports_to_transformers(ray_local: None, tmp_path: Path) -> None:
    """Through the Python API at W = 2: the saved (tied) Llama split tp 2 with sequence parallel (the residual
    stream and norms hold half the positions per rank). The loss of step 1 (computed before its update) equals
    transformers' own `from_pretrained` model's forward of the same 12 samples in one process. After two steps the
    run exports (`raytrain.export`): transformers loads the export with no missing or unexpected key, the tie held
    once, and its loss on those samples equals the run's model's (`raytrain.load_model`). (Pipeline stages reading
    their own tensors, a zero3 rank reading its shard: the gloo tests above; a classifier fine-tuned at zero3 and
    exported: test_examples.py.)"""
    import ray.cloudpickle
    import transformers

    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig, ParallelConfig
    from raytrain.model_export import export, load_model
    from raytrain.toy import token_arrays, token_dataset
    from raytrain.trainer import ElasticTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules["user_models"])
    trainer = ElasticTrainer(
        model_fn=llama,
        tp_plan_fn=lambda model: LLAMA_TP_PLAN,
        loss_fn=_ce_loss,
        optimizer_fn=lambda params, lr: torch.optim.AdamW(params, lr=lr),
        datasets={"train": token_dataset(48, vocab=64, context=8)},
        batch=BatchConfig(global_batch=12, micro_batch=4),
        lr=LRConfig(base_lr=1e-3),
        loop=LoopConfig(max_steps=2, strategy="ddp", audit_samples=True, id_column="id"),
        parallel=ParallelConfig(tp=2, sequence_parallel=True),
        checkpoint=CheckpointConfig(storage_path=str(tmp_path), run_name="finetune", every_steps=2),
        cluster=ClusterConfig(min_workers=2, max_workers=2),
        required_columns=("x", "y"),
        init_from=str(saved("llama")),
    )
    result = trainer.fit()
    first = json.loads(Path(result.metrics_path).read_text().splitlines()[0])
    ids = json.loads(Path(result.samples_path or "").read_text().splitlines()[0])["ids"]
    arrays = token_arrays(48, vocab=64, context=8)
    batch = {k: torch.from_numpy(arrays[k][ids]) for k in ("x", "y")}
    with torch.no_grad():
        expected = float(_ce_loss(transformers.LlamaForCausalLM.from_pretrained(saved("llama")), batch).mean())
    assert first["step"] == 1 and first["loss"] == pytest.approx(expected, rel=1e-5)
    log = (tmp_path / "finetune" / "raytrain.log").read_text()
    assert f"{saved('llama')}: read " in log and "sequence parallel over the blocks model.layers" in log
    exported = export(result.storage_uri, str(tmp_path / "hf"))
    assert exported.step == 2
    theirs, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    ours = load_model(result.storage_uri, llama)
    with torch.no_grad():
        trained = float(_ce_loss(ours, batch).mean())
        assert float(_ce_loss(theirs, batch).mean()) == trained and trained != first["loss"]
