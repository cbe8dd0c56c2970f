"""Where things live in a state folder.

    DIR/                      the state folder (created 0700)
      models.toml             optional: more GGUF models with aliases
      epoch                   the last runtime epoch handed out (never reused)
      admin.token             the admin bearer token (0600), created on first start
      aotx.db                 credentials and grant definitions (SQLite, 0600)
      model-hashes.json       SHA-256 of model files, cached by file identity
      memory/<principal>/     automatic-memory lineage: gen-<N>.json (0600)
      run/                    runtime folder, 0700
        device.lock           held by the running device (one device per folder)
        gateway.url           where the gateway listens (read by `aotx status`)
        service.sock          the broker's SOCK_SEQPACKET socket
        mailboxes             the mapped mailbox region (0600)
        device.bell           doorbell FIFO read by the device
        broker.bell           doorbell FIFO read by the broker
        vllm/                 vLLM's engine cores' ZMQ sockets (vllm_sockets)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

SUN_PATH_MAX = 107


class PathError(Exception):
    pass


def ensure_private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


@dataclass(frozen=True)
class RuntimePaths:
    state_dir: str

    @property
    def run_dir(self) -> str:
        return os.path.join(self.state_dir, "run")

    @property
    def socket(self) -> str:
        return os.path.join(self.run_dir, "service.sock")

    @property
    def region(self) -> str:
        return os.path.join(self.run_dir, "mailboxes")

    @property
    def device_bell(self) -> str:
        return os.path.join(self.run_dir, "device.bell")

    @property
    def broker_bell(self) -> str:
        return os.path.join(self.run_dir, "broker.bell")

    @property
    def vllm_dir(self) -> str:
        return os.path.join(self.run_dir, "vllm")

    @property
    def epoch_file(self) -> str:
        return os.path.join(self.state_dir, "epoch")

    @property
    def models_file(self) -> str:
        return os.path.join(self.state_dir, "models.toml")

    @property
    def admin_token(self) -> str:
        return os.path.join(self.state_dir, "admin.token")

    def ensure(self) -> None:
        if len(os.fsencode(self.socket)) > SUN_PATH_MAX:
            raise PathError(
                f"socket path {self.socket!r} is longer than {SUN_PATH_MAX} bytes; "
                "choose a shorter --state-dir")
        ensure_private_dir(self.state_dir)
        ensure_private_dir(self.run_dir)


def for_state_dir(state_dir: str) -> RuntimePaths:
    return RuntimePaths(os.path.abspath(state_dir))


def vllm_sockets(paths: RuntimePaths) -> None:
    """Have vLLM name its ZMQ sockets in ``run/vllm``, unless ``VLLM_RPC_BASE_PATH``
    says where: called in the device's process, before vLLM starts; the engine cores it
    starts inherit the variable.

    vLLM names a model's sockets in the temporary folder (``/tmp/<uuid>``), several an
    engine core, and leaves them there when its processes end: about 70 a run of
    tests/vllm.  In the run folder they are private to the service and in one place,
    and the device removes what earlier ones left (:func:`clear_vllm_sockets`)."""
    where = paths.vllm_dir
    if "VLLM_RPC_BASE_PATH" in os.environ or len(os.fsencode(where)) + 37 > SUN_PATH_MAX:
        return  # (37: "/" and a uuid; a longer path would not bind)
    ensure_private_dir(where)
    os.environ["VLLM_RPC_BASE_PATH"] = where


def clear_vllm_sockets(paths: RuntimePaths) -> None:
    """Remove what earlier devices' vLLM processes left in ``run/vllm``: only for the
    device that holds the folder's lock (no other uses them), before it starts a model."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(paths.vllm_dir):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(paths.vllm_dir, name))
