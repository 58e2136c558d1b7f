"""Security and `ray job submit`: a two-file project submitted to a token-authenticated cluster trains, and a
submission or a run without the token is refused (the run in one line); no secret lands in the run's files; the
dashboard of a Ray instance raytrain starts listens on 127.0.0.1 only. (That no checkpoint file is unpickled as
arbitrary code is in tests/test_checkpoint_files.py.)"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from ray_helpers import char_project_checkout, ray_head, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def submit(dashboard: str, env: dict[str, str], working_dir: Path, runs: Path) -> subprocess.CompletedProcess[str]:
    command = ["ray", "job", "submit", "--address", dashboard, "--working-dir", str(working_dir), "--no-wait", "--"]
    command += ["raytrain", "fit", "char_project/job.toml", "--storage", str(runs), "--steps", "8", "--workers", "2"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=working_dir.parent)


def test_ray_job_submit_runs_a_two_file_project_on_a_token_cluster_and_no_secret_lands_in_the_run(
    tmp_path: Path,
) -> None:
    """`ray job submit --working-dir DIR -- raytrain fit char_project/job.toml` against a token-authenticated
    `ray start --head` (`ray_helpers.ray_head`, stopped without `ray stop`): refused without the token and with a
    wrong one; with it, the two-file project trains (it failed with "No module named 'charmodel'" before), the
    end-of-run summary reaches the job's logs, and neither the token nor a secret in the job's environment lands
    in the run's files."""
    token = secrets.token_hex(16)
    secret = "AKIA" + secrets.token_hex(8).upper()  # what an AWS key looks like, set in the job's environment
    home = tmp_path / "home"  # no ~/.ray/auth_token here: only what the test gives counts
    home.mkdir()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "HOME": str(home)}
    working_dir, runs = char_project_checkout(tmp_path / "project"), tmp_path / "runs"
    with ray_head(dashboard=True, env=auth) as head:
        dashboard = head["dashboard"]
        without = {k: v for k, v in head["env"].items() if k != "RAY_AUTH_TOKEN"}
        refused = submit(dashboard, without, working_dir, runs)
        assert refused.returncode != 0
        assert "Token authentication is enabled but Ray couldn't find an authentication token" in refused.stderr
        wrong = submit(dashboard, {**head["env"], "RAY_AUTH_TOKEN": secrets.token_hex(16)}, working_dir, runs)
        assert wrong.returncode != 0 and "AuthenticationError" in wrong.stderr, wrong.stderr[-1000:]
        # a run pointed at the cluster without its token, in token mode or not: one line saying what to set, in
        # seconds, exit 2 (token mode: a traceback; not: ~28 s of Ray's retries, then a traceback)
        run = [sys.executable, "-m", "raytrain.cli", "fit", str(REPO / "examples" / "fit_mlp.toml"), "--dry-run"]
        for mode in ("token", None):
            env = {k: v for k, v in without.items() if k != "RAY_AUTH_MODE"} | {"RAY_ADDRESS": head["address"]}
            env |= {"RAY_AUTH_MODE": mode} if mode else {}
            tokenless = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
            assert tokenless.returncode == 2, tokenless.stderr[-3000:]
            refused = f"raytrain: error: the Ray cluster at RAY_ADDRESS='{head['address']}' refused this process: it "
            where = "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) to the cluster's token ("
            assert tokenless.stderr.strip().splitlines() == [
                refused
                + (
                    "uses token authentication and the token here is missing or not the cluster's; set "
                    + where
                    + "Token authentication is enabled but no authentication token was found)"
                    if mode
                    else "uses token authentication and this process does not (RAY_AUTH_MODE unset): set "
                    "RAY_AUTH_MODE=token and "
                    + where
                    + "InvalidAuthToken: Authentication token is missing or incorrect)"
                )
            ], tokenless.stderr[-3000:]
        with_token = {**head["env"], "AWS_SECRET_ACCESS_KEY": secret}
        attempts: list[str] = []

        def accepted() -> str | None:  # the dashboard answers before its job agent is ready: submit again
            done = submit(dashboard, with_token, working_dir, runs)
            attempts.append(done.stdout[-1500:] + done.stderr[-1500:])
            return _accepted(done)

        try:
            job = wait_for("the submission with the token to be accepted", accepted, 240, 5)
        except AssertionError as err:  # say what the CLI answered
            raise AssertionError(f"{err}; last answer:\n{attempts[-1] if attempts else '(none)'}") from None

        def cli(*args: str) -> str:
            done = subprocess.run(
                ["ray", "job", *args, "--address", dashboard, job],
                env=head["env"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            return done.stdout + done.stderr  # the CLI logs part of its answer to stderr

        def finished() -> str | None:
            text = cli("status").upper()
            return next((s for s in ("SUCCEEDED", "FAILED", "STOPPED") if f"JOB '{job.upper()}' {s}" in text), None)

        state = wait_for(f"job {job} to finish", finished, 420, 3)
        logs = cli("logs")
        assert state == "SUCCEEDED", logs[-4000:]
    metrics = [json.loads(line) for line in (runs / "char-gru" / "metrics.jsonl").read_text().splitlines() if line]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert {m["global_batch_size"] for m in metrics} == {64} and {m["world_size"] for m in metrics} == {2}
    assert "run directory" in logs and "final loss" in logs  # the end-of-run summary reached the job's logs
    files = [p for p in (runs / "char-gru").rglob("*") if p.is_file()]
    assert any(p.name == "metrics.jsonl" for p in files)
    for path in files:
        content = path.read_bytes()
        assert token.encode() not in content and secret.encode() not in content, f"a secret in {path}"


def _accepted(done: subprocess.CompletedProcess[str]) -> str | None:
    found = re.search(r"raysubmit_\w+", done.stdout + done.stderr) if done.returncode == 0 else None
    return found.group(0) if found else None


def test_the_dashboard_raytrain_starts_listens_on_loopback_only(tmp_path: Path) -> None:
    code = (
        "import os, sys, time\n"
        "from raytrain.trainer import connect_ray\n"
        "connect_ray()\n"
        "print(os.environ['RAY_API_SERVER_ADDRESS'], flush=True)\n"
        "sys.stdin.readline()\n"
    )
    home = tmp_path / "home"  # a machine where `ray get-auth-token --generate` was run: a token in ~/.ray
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE")}
    env["HOME"] = str(home)
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert process.stdout is not None
        url = ""
        while not url.startswith("http"):  # after raytrain's line saying it started a local instance
            line = process.stdout.readline()
            assert line, "connect_ray printed no state API address"
            url = line.strip()
        port = int(url.rsplit(":", 1)[1])
        listening = wait_for(f"a socket listening on port {port}", lambda: _listeners(port), 60)
        assert listening == {"127.0.0.1"}, f"the dashboard listens on {listening}"
    finally:
        _, stderr = process.communicate(input="\n", timeout=120)  # the newline lets the child exit
    assert json.dumps(url).startswith('"http://127.0.0.1:')
    # With a token on the machine Ray turns token authentication on and warns so on every run; raytrain says
    # RAY_AUTH_MODE=token explicitly (and has this process's Ray config read it again): the same protection, the
    # instance starts, no warning.
    assert "Token authentication is enabled for this Ray cluster" not in stderr, stderr[-2000:]


def _listeners(port: int) -> set[str]:
    """The local addresses of TCP sockets listening on `port` (IPv4, from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found
