"""``aotx serve`` as its operator meets it: a models file the device refuses stops the
service with the reason (not a restart loop), and the supervisor outlives a closed
stdout (``| head``) while its components never outlive it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import httpx

from ..helpers import eventually, make_service


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended
        return f.read().split(") ")[-1][0] != "Z"


def test_a_refused_models_file_stops_serve_with_its_reason() -> None:
    svc = make_service(models="[default]\nslots = 0\n")
    try:
        r = subprocess.run([sys.executable, "-m", "aotx", "serve", "--state-dir", svc.state_dir,
                            "--port", str(svc.port)], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 78, r.stderr[-3000:]  # EX_CONFIG, once
        assert "aotx device: refused to start: slots must be a positive integer" in r.stderr
        assert "Traceback" not in r.stderr and r.stderr.count("serve.started component=device") == 1
    finally:
        shutil.rmtree(svc.state_dir, ignore_errors=True)


def test_serve_outlives_its_stdout_and_its_components_end_with_it() -> None:
    svc = make_service()
    log = open(os.path.join(svc.state_dir, "serve.log"), "ab")
    svc.log_path = log.name
    proc = subprocess.Popen([sys.executable, "-m", "aotx", "serve", "--state-dir", svc.state_dir,
                             "--port", str(svc.port)], stdout=subprocess.PIPE, stderr=log,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert proc.stdout is not None
        proc.stdout.close()  # the reader went away (aotx serve | head -1)
        eventually(lambda: httpx.get(svc.url + "/readyz", timeout=2).status_code == 200, 180)
        assert "event=serve.stdout_closed" in eventually(
            lambda: "stdout_closed" in svc.read_log() and svc.read_log(), 10)
        assert proc.poll() is None  # still supervising
        pids = svc.children()
        assert set(pids) == {"device", "broker", "gateway"} and all(map(alive, pids.values()))
        proc.kill()  # the supervisor dies at once: its components are told to stop
        proc.wait()
        eventually(lambda: not any(alive(p) for p in pids.values()), 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in svc.children().values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(svc.state_dir, ignore_errors=True)
