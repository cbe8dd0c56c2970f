"""The runtime epoch: each start of the device on a state folder is a new one, handed
out durably (docs/reliability.md)."""

from __future__ import annotations

import os

from .. import ids
from ..paths import RuntimePaths


def next_epoch(paths: RuntimePaths, device_id: int = 0) -> int:
    """Hand out the next runtime epoch for this state folder, durably, never twice: the
    folder's activation count, under ``device_id`` (ids.py)."""
    last = 0
    try:
        with open(paths.epoch_file) as f:
            last = int(f.read().strip() or 0)
    except FileNotFoundError:
        pass
    except ValueError:
        raise SystemExit(f"{paths.epoch_file} is corrupt; refusing to guess an epoch") from None
    epoch = last + 1
    tmp = paths.epoch_file + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{epoch}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, paths.epoch_file)
    dfd = os.open(paths.state_dir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return ids.make_epoch(device_id, epoch)
