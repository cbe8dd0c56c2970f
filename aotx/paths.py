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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_SUN_PATH_MAX = 107


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
    def epoch_file(self) -> str:
        return os.path.join(self.state_dir, "epoch")

    @property
    def models_file(self) -> str:
        return os.path.join(self.state_dir, "models.toml")

    @property
    def admin_token(self) -> str:
        return os.path.join(self.state_dir, "admin.token")

    def ensure(self) -> None:
        if len(os.fsencode(self.socket)) > _SUN_PATH_MAX:
            raise PathError(
                f"socket path {self.socket!r} is longer than {_SUN_PATH_MAX} bytes; "
                "choose a shorter --state-dir")
        ensure_private_dir(self.state_dir)
        ensure_private_dir(self.run_dir)


def for_state_dir(state_dir: str) -> RuntimePaths:
    return RuntimePaths(os.path.abspath(state_dir))
