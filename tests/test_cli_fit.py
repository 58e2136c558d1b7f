"""`raytrain fit` input handling through the real console script: dry run, and one-line errors with exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "fit_mlp.toml")


@pytest.fixture
def head(ray_head_env: dict[str, str]) -> dict[str, str]:
    """The dry runs that reach Ray go to the session's shared head (`conftest.ray_head_env`); the local start is
    `test_dry_run_prints_the_plan_for_every_world_size_and_starts_nothing`'s."""
    return ray_head_env


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [
        shutil.which("raytrain") or sys.executable,
        *([] if shutil.which("raytrain") else ["-m", "raytrain.cli"]),
    ]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def test_dry_run_prints_the_plan_for_every_world_size_and_starts_nothing(tmp_path: Path, head: dict[str, str]) -> None:
    """The example with its validation set as Parquet files (read by Ray Data on the driver): the plan, and no
    line of Ray's (its `INFO streaming_executor ...` lines came with every read)."""
    from raytrain.toy import write_regression_parquet

    write_regression_parquet(tmp_path / "val", 320, features=16, files=2, seed=1)
    (tmp_path / "val_entry.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO / 'examples')!r})\n"
        "from fit_entry import loss, model, optimizer, tp_plan  # noqa: F401\n"
        "from raytrain.toy import regression_dataset\n\n"
        "def datasets():\n"
        f"    return {{'train': regression_dataset(3200, features=16, seed=0), 'val': {str(tmp_path / 'val')!r}}}\n"
    )
    job = write(tmp_path, Path(EXAMPLE).read_text().replace('"fit_entry.py:', '"val_entry.py:'))
    result = run_cli("fit", job, "--dry-run", "--workers", "2:3", "--storage", str(tmp_path / "runs"), env=head)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if not line.startswith("[raytrain] ")] == [], result.stderr
    assert "world 2: accumulation 2, samples/rank [32,32]" in result.stdout
    assert "world 3: accumulation 2, samples/rank [22,21,21]" in result.stdout
    assert "zero3" in result.stdout and "strategy: ddp" in result.stdout
    assert "(sqrt rule, warmup 5, cosine schedule)" in result.stdout
    assert "gpu_memory_bytes" not in result.stdout  # suggests nothing that is neither a flag nor a TOML key
    assert not (tmp_path / "runs").exists()


def test_dry_run_names_the_recovery_mode_and_refuses_live_with_what_it_does_not_run(
    tmp_path: Path, head: dict[str, str]
) -> None:
    (tmp_path / "live_entry.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO / 'examples')!r})\n"
        "from fit_entry import loss, model, optimizer, tp_plan  # noqa: F401\n"
        "from raytrain.toy import regression_dataset\n\n"
        "def datasets():\n    return {'train': regression_dataset(3200, features=16, seed=0)}  # no validation set\n"
    )
    text = Path(EXAMPLE).read_text().replace('"fit_entry.py:', '"live_entry.py:')
    job = write(tmp_path, text.replace("[cluster]\n", '[cluster]\nrecovery = "live"\n'))
    result = run_cli("fit", job, "--dry-run", "--storage", str(tmp_path / "runs"), env=head)
    assert result.returncode == 0, result.stderr
    assert "recovery: live (2 torchft replica groups of one worker (min 1); a lost worker's peers" in result.stdout
    plain = run_cli("fit", EXAMPLE, "--dry-run", "--storage", str(tmp_path / "runs"), env=head)
    assert "recovery: restart (Ray Train restarts the worker group" in plain.stdout
    zero = run_cli("fit", job, "--dry-run", "--strategy", "zero2", "--storage", str(tmp_path / "runs"), env=head)
    assert zero.returncode == 2
    assert "loop.strategy must be 'ddp' or 'auto' with parallel.dp_shard=1 (each replica group holds" in zero.stderr
    example = Path(EXAMPLE).read_text().replace('"fit_entry.py:', f'"{REPO}/examples/fit_entry.py:')
    with_val = write(tmp_path, example.replace("[cluster]\n", '[cluster]\nrecovery = "live"\n'))
    refused = run_cli("fit", with_val, "--dry-run", "--storage", str(tmp_path / "runs"), env=head)  # as a start does
    assert refused.returncode == 2 and "does not run validation (datasets['val']) yet" in refused.stderr


def test_dry_run_with_tp_or_pp_shows_the_layouts_and_checks_the_plan(tmp_path: Path, head: dict[str, str]) -> None:
    result = run_cli(
        "fit", EXAMPLE, "--dry-run", "--workers", "2:4", "--tp", "2", "--storage", str(tmp_path / "r"), env=head
    )
    assert result.returncode == 0, result.stderr
    assert "W 2 = dp 1, tp 2, pp 1: accumulation 4, samples/replica [64]" in result.stdout
    assert "W 4 = dp 2, tp 2, pp 1: accumulation 2, samples/replica [32,32]" in result.stdout
    assert "W 3 " not in result.stdout  # never a partial replica
    assert "tensor parallel: 2 linear layers split over tp = 2" in result.stdout  # the example's tp_plan entry
    piped = run_cli(
        "fit", EXAMPLE, "--dry-run", "--workers", "4", "--pp", "2", "--storage", str(tmp_path / "r"), env=head
    )
    assert piped.returncode == 0, piped.stderr
    assert "pipeline parallel: 4 units in 2 stages of" in piped.stdout
    odd = run_cli(
        "fit", EXAMPLE, "--dry-run", "--workers", "3", "--tp", "2", "--storage", str(tmp_path / "r"), env=head
    )
    assert odd.returncode == 2 and "min_workers must be a multiple of tp * pp" in odd.stderr


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


ENTRY = f"""[entry]
model = "{REPO}/examples/fit_entry.py:model"
loss = "{REPO}/examples/fit_entry.py:loss"
optimizer = "{REPO}/examples/fit_entry.py:optimizer"
datasets = "{REPO}/examples/fit_entry.py:datasets"
"""


def test_dry_run_with_tp_pp_auto_shows_the_layout_auto_chose(tmp_path: Path, head: dict[str, str]) -> None:
    # the example's MLP (1,153 parameters) on 2 workers of 12,000 bytes: no dp strategy fits 9,600 bytes, tp 2 does
    # (tests/test_parallel_layout.py has the numbers)
    text = ENTRY.replace("datasets =", f'tp_plan = "{REPO}/examples/fit_entry.py:tp_plan"\ndatasets =') + (
        "[batch]\nglobal_batch = 8\nmicro_batch = 2\n[lr]\nbase_lr = 0.1\n[cluster]\nmin_workers = 2\n"
        'max_workers = 4\n[parallel]\ntp = "auto"\npp = "auto"\ndevice_memory_gb = 1.2e-5\nworkers_per_node = 2\n'
    )
    result = run_cli("fit", write(tmp_path, text), "--dry-run", "--storage", str(tmp_path / "r"), env=head)
    assert result.returncode == 0, result.stderr
    chose = "layout auto -> tp 2, pp 1 on 2 workers of 1.2e-05 GB, 2 per node, counted with zero2 on the dp axis"
    assert chose in result.stdout
    assert "W 2 = dp 1, tp 2, pp 1: accumulation 4, samples/replica [8]" in result.stdout
    assert "tensor parallel: 2 linear layers split over tp = 2" in result.stdout
    odd = run_cli(
        "fit", write(tmp_path, text), "--dry-run", "--tp", "auto", "--pp", "auto", "--workers", "2:3", env=head
    )
    assert odd.returncode == 2  # the chosen layout's rules apply, and the message says where tp 2 came from
    assert (
        "max_workers must be a multiple of tp * pp (2 * 1 = 2)" in odd.stderr and "(layout auto -> tp 2" in odd.stderr
    )
    alone = run_cli("fit", EXAMPLE, "--dry-run", "--tp", "auto", "--workers", "2", env=head)  # implies --pp auto
    assert alone.returncode == 2 and "set device_memory_gb" in alone.stderr
    half = run_cli("fit", write(tmp_path, text), "--dry-run", "--tp", "2", env=head)
    assert half.returncode == 2 and "set both to 'auto' or both to integers, got tp=2, pp='auto'" in half.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            ENTRY + "[batch]\nglobal_batch = 8\nmicro_batch = 2\nmicrobatch = 3\n[lr]\nbase_lr = 0.1\n",
            "unknown key(s) ['microbatch'] in [batch]; valid keys are ['drop_last', 'global_batch', 'micro_batch']",
        ),
        (
            ENTRY + "[batch]\nglobal_batch = 8\n[lr]\nbase_lr = 0.1\n",
            "[batch] is missing required key(s) ['micro_batch']",
        ),
        ('[entry]\nmodel = "x:y"\n', "[entry] is missing ['loss', 'optimizer', 'datasets']"),
        (
            ENTRY + "[batch]\nglobal_batch = 8\nmicro_batch = 2\n[lr]\nbase_lr = 0.1\n"
            "[cluster]\nmin_workers = 3\nmax_workers = 2\n",
            "min_workers must be <= max_workers, got min_workers=3 > max_workers=2",
        ),
        (
            ENTRY.replace("fit_entry.py:model", "fit_entry.py:nope") + "[batch]\nglobal_batch = 8\nmicro_batch = 2\n"
            "[lr]\nbase_lr = 0.1\n",
            "has no callable 'nope'",
        ),
        ("[entry\n", "is not valid TOML"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, text: str, message: str) -> None:
    result = run_cli("fit", write(tmp_path, text), "--dry-run")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_unreachable_cluster_address_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli("fit", EXAMPLE, "--storage", str(tmp_path), env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert result.returncode == 2
    assert "cannot reach the Ray cluster at RAY_ADDRESS='127.0.0.1:1'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unwritable_storage_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run_cli("fit", EXAMPLE, "--storage", str(blocker / "runs"), "--steps", "1")
    assert result.returncode == 2
    assert "is not a directory" in result.stderr and "Traceback" not in result.stderr


def test_dry_run_runs_loss_fn_on_real_rows_as_a_real_start_does(tmp_path: Path, head: dict[str, str]) -> None:
    """A loss of the wrong shape fails the dry run, in one line, as it fails the real start (it passed before)."""
    entry = Path(REPO / "examples" / "fit_entry.py").read_text()
    (tmp_path / "entry.py").write_text(
        entry.replace(
            'return (model(batch["x"]) - batch["y"]) ** 2', 'return ((model(batch["x"]) - batch["y"]) ** 2).mean()'
        )
    )
    job = write(tmp_path, Path(EXAMPLE).read_text().replace("fit_entry.py", str(tmp_path / "entry.py")))
    result = run_cli("fit", job, "--dry-run", "--storage", str(tmp_path / "runs"), env=head)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "must return one loss per sample, a tensor of shape [2] for 2 samples, got shape ()" in result.stderr


def test_the_configuration_reference_is_generated_from_the_config_classes() -> None:
    """docs/config.md is `python -m raytrain.cli.config_reference`'s output, and names every key of every table."""
    import dataclasses

    from raytrain.cli.config_reference import reference
    from raytrain.cli.fit_config import ENTRY_KEYS, OPTIONAL_ENTRY_KEYS, SECTIONS

    text = (REPO / "docs" / "config.md").read_text()
    assert text == reference(), "docs/config.md is stale: python -m raytrain.cli.config_reference > docs/config.md"
    for table, cls in SECTIONS.items():
        section = text.split(f"## `[{table}]`", 1)[1].split("\n## ", 1)[0]
        for field in dataclasses.fields(cls):
            row = next(line for line in section.splitlines() if line.startswith(f"| `{field.name}` |"))
            assert not row.endswith("|  |"), f"[{table}] {field.name} has no description in its docstring"
    for key in (*ENTRY_KEYS, *OPTIONAL_ENTRY_KEYS, "init_from", "required_columns"):
        assert f"| `{key}` |" in text
