"""docs/operations.md's sequence for `deploy/job.py` with direct ingress (`export RAY_AUTH_MODE=token`, `ray
get-auth-token --generate`, `ray start --head` for direct ingress, then `ray job submit --working-dir .
-- python deploy/job.py --config deploy/tiny-cpu.yaml --ingress direct`) against a local Ray head of
its own starts the endpoint, which then serves completions from the replica's own HTTP server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import free_port

from rackserve.cluster.ray_env import WORKER_ENV
from rackserve.models.deepseek_v4.tiny import default_cache_dir
from rackserve.serve.ingress import direct_ingress_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ray_head(tmp_path):
    """A head node in its own process group (so stopping it leaves the session's cluster alone),
    every port its own, this interpreter's tools first on PATH (the job runs `python`), started as
    docs/operations.md says: token authentication on, for direct ingress on a port of its own.

    Ray keeps the token in ~/.ray/auth_token (`ray get-auth-token --generate` writes it, `ray start`
    and `ray job submit` read it), so HOME is a directory of this test's own: the test starts, as a
    new user does, with no token, and it neither reads the user's token nor leaves one behind. A
    token given by RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH would come before the file: those go. The
    tiny model stays in the cache it would have used (RACKSERVE_CACHE, else ~/.cache/rackserve)."""
    ports = {name: free_port() for name in ("port", "dashboard-port", "dashboard-agent-listen-port",
                                            "dashboard-agent-grpc-port", "metrics-export-port",
                                            "runtime-env-agent-port", "node-manager-port", "object-manager-port",
                                            "ray-client-server-port")}
    serve_port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
           "RACKSERVE_CACHE": str(default_cache_dir().parent), "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ""}
    ray = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, cwd=ROOT, capture_output=True, timeout=120,
                   check=True)
    assert (home / ".ray" / "auth_token").is_file()
    env_head = {**env, **WORKER_ENV, **direct_ingress_env(serve_port)}
    args = [ray, "start", "--head", "--block", "--num-cpus", "4",
            "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--disable-usage-stats",
            "--temp-dir", f"/tmp/rackserve-job-{os.getpid()}", *[f"--{k}={v}" for k, v in ports.items()]]
    head = subprocess.Popen(args, env=env_head, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
    auth = {"Authorization": f"Bearer {(home / '.ray' / 'auth_token').read_text().strip()}"}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the job agent registers a little after the dashboard answers
        try:
            if httpx.get(f"{dashboard}/api/version", headers=auth, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    yield dashboard, env, serve_port
    # the head is this test's alone: the whole group at once, no graceful stop to wait for
    os.killpg(head.pid, signal.SIGKILL)
    head.wait(timeout=60)


@pytest.mark.slow
def test_ray_job_submit_starts_the_endpoint(ray_head):
    dashboard, env, port = ray_head
    assert httpx.get(f"{dashboard}/api/version", timeout=10).status_code == 401  # the head wants the token
    submit = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", dashboard, "--working-dir", ".",
              "--", "python", "deploy/job.py", "--config", "deploy/tiny-cpu.yaml", "--port", str(port),
              "--ingress", "direct"]
    for _ in range(10):  # "No available agent" until the head's job agent has registered
        done = subprocess.run(submit, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
        if "No available agent" not in done.stdout + done.stderr:
            break
        time.sleep(3)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"rackserve is serving 'tiny' at http://127.0.0.1:{port}/v1" in done.stdout
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "The rack hums", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
