"""``aotx serve``: start the device, the broker and the gateway, and keep them up.

Each component is its own process (``python -m aotx device|broker|gateway``).
The supervisor starts them in order (device, broker, gateway), waits until the
gateway answers ``/readyz``, prints how to call the service, restarts a
component that dies with exponential backoff, and on SIGINT/SIGTERM stops them
in reverse order (SIGTERM, then SIGKILL after a grace period).  A device that is alive
but stops answering is killed and so restarted too (:mod:`aotx.watchdog`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import Settings
from .paths import RuntimePaths
from .watchdog import DeviceWatch

log = logging.getLogger("aotx.serve")

GRACE_SECONDS = 10.0
MAX_BACKOFF = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
#: The device's exit status when its models file or a model is refused at load
#: (sysexits' EX_CONFIG): starting it again would be refused again.
EX_CONFIG = 78


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    backoff: float = 0.5
    next_start: float = 0.0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     preexec_fn=_end_with(os.getpid()))
        self.started_at = time.monotonic()
        log.info("event=serve.started component=%s pid=%d", self.name, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


#: prctl, looked up here: a child between fork and exec should not load libraries.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _end_with(parent: int) -> Callable[[], None]:
    """For a child, before it runs: SIGTERM when the supervisor dies (killed, or its
    output closed under it), so that no component serves on unsupervised; and if it
    died already, between the fork and this, no start at all."""
    def arm() -> None:
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)
    return arm


def _wait_ready(url: str, children: list[Child], timeout: float,
                stopping: Callable[[], bool] = lambda: False) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping():
        if any(c.proc is not None and c.proc.poll() is not None for c in children):
            return False
        if _ready(url):
            return True
        time.sleep(0.1)
    return False


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def serve(paths: RuntimePaths, host: str, port: int, models_file: str | None,
          mailboxes: int, device_args: list[str] | None = None, log_level: str = "INFO",
          settings: Settings | None = None) -> int:
    from .gateway.credentials import ensure_admin_token

    settings = settings or Settings()
    paths.ensure()
    ensure_admin_token(paths.admin_token)
    base = [sys.executable, "-m", "aotx", "--log-level", log_level]
    common = ["--state-dir", paths.state_dir]
    dev = base + ["device", *common, "--mailboxes", str(mailboxes), *(device_args or [])]
    if models_file:
        dev += ["--models", models_file]
    children = [
        Child("device", dev),
        Child("broker", base + ["broker", *common, "--mailboxes", str(mailboxes)]),
        Child("gateway", base + ["gateway", *common, "--host", host, "--port", str(port)]),
    ]
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for c in children:
            c.start()
        url_host = f"[{host}]" if ":" in host else host
        url = f"http://{url_host}:{port}"
        if _wait_ready(url + "/readyz", children, timeout=600, stopping=lambda: stopping) \
                and not stopping:
            _banner(url, paths.state_dir, paths.admin_token)
        elif not stopping and children[0].proc is not None \
                and children[0].proc.poll() != EX_CONFIG:  # (_supervise stops for that)
            log.error("event=serve.not_ready url=%s", url)
        return _supervise(children, DeviceWatch(paths.socket, settings.hang_seconds),
                          lambda: stopping, ready=lambda: _ready(url + "/readyz"))
    finally:
        _stop_all(children)


def _banner(url: str, state_dir: str, token_path: str) -> None:
    """How to call the service, on stdout; nothing if stdout has gone (``| head``)."""
    try:
        print(f"\naotx is ready on {url}\n"
              f"  state folder: {state_dir}\n"
              f"  admin token:  {token_path} (mode 0600)\n"
              f"try:\n"
              f"  curl -s {url}/v1/chat/completions \\\n"
              f"    -H \"Authorization: Bearer $(cat {token_path})\" \\\n"
              f"    -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"smollm2\", \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], "
              f"\"max_tokens\": 64}}'\n",
              flush=True)
    except BrokenPipeError:
        log.warning("event=serve.stdout_closed")
        # what is left in the buffer would fail again at exit ("Exception ignored", 120)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _supervise(children: list[Child], watch: DeviceWatch, stopping: Callable[[], bool],
               ready: Callable[[], bool]) -> int:
    """Restart what exits and health-check the device, until told to stop (0), or until
    a device that was never ready refuses its models file (EX_CONFIG)."""
    device, was_ready = children[0], False
    try:
        while not stopping():
            now = time.monotonic()
            if not was_ready and device.proc is not None:
                if device.proc.poll() == EX_CONFIG:  # its reason is on stderr above:
                    log.error("event=serve.refused component=device")  # it would be again
                    return EX_CONFIG
                was_ready = device.alive() and ready()
            for c in children:
                if _restart_if_exited(c, now) and c.name == "device":
                    watch.device_started()
            _check_device(device, children[1], watch, now)
            time.sleep(0.1)
        return 0
    finally:
        watch.close()


def _restart_if_exited(c: Child, now: float) -> bool:
    """Note a child that exited and start it again once its backoff has passed;
    True when it was started."""
    if c.proc is not None and c.proc.poll() is not None:
        code = c.proc.returncode
        if now - c.started_at > 60:
            c.backoff = 0.5  # it ran for a while: start the backoff afresh
        log.warning("event=serve.exited component=%s code=%s restart_in=%.1fs",
                    c.name, code, c.backoff)
        c.proc = None
        c.next_start = now + c.backoff
        c.backoff = min(c.backoff * 2, MAX_BACKOFF)
    if c.proc is None and now >= c.next_start:
        c.restarts += 1
        log.info("event=serve.restart component=%s restarts=%d", c.name, c.restarts)
        c.start()
        return True
    return False


def _check_device(device: Child, broker: Child, watch: DeviceWatch, now: float) -> None:
    """Health-check the device through the broker; kill it when it is alive but hung
    (its exit then restarts it, a new epoch, like any exit)."""
    if not broker.alive():
        watch.close()  # the broker's own failure: nothing to learn of the device
        return
    if not device.alive() or not watch.tick(now):
        return
    assert device.proc is not None
    log.error("event=serve.device_hung pid=%d silent_s=%.1f", device.proc.pid,
              watch.rule.silent_for(now))
    device.proc.kill()  # SIGKILL: a stopped process would not act on SIGTERM
    try:
        device.proc.wait(GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        log.error("event=serve.kill_failed component=device pid=%d", device.proc.pid)
    watch.device_started()  # no verdict on this device any more; its successor starts afresh


def _stop_all(children: list[Child]) -> None:
    log.info("event=serve.stopping")
    for c in reversed(children):
        if c.alive():
            assert c.proc is not None
            c.proc.send_signal(signal.SIGTERM)
            try:
                c.proc.wait(GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                log.warning("event=serve.kill component=%s", c.name)
                c.proc.kill()
                c.proc.wait()
    log.info("event=serve.stopped")


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s",
                        stream=sys.stderr)
    for noisy in ("httpx", "httpcore"):  # one line per HTTP call is not an event
        logging.getLogger(noisy).setLevel(logging.WARNING)
