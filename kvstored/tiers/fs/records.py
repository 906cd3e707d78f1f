# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fs tier's namespace records: one small file per namespace under <root>/_kvstored/namespaces/,
written to a temporary name, fsync'ed and renamed into place (a reader sees the old record or the
new one). Blocking: the fs tier runs these in its threads."""

from __future__ import annotations

import itertools
import logging
import os

from kvstored.chunks import chunkfile
from kvstored.tiers.fs import io as fs_io

log = logging.getLogger(__name__)

_TMP_SEQ = itertools.count()


def write_record(root: str, namespace_id: str, record: bytes, file_mode: int = 0o600, dir_mode: int = 0o700) -> None:
    path = os.path.join(root, chunkfile.record_relpath(namespace_id))
    directory, name = os.path.split(path)
    fs_io.make_dirs(directory, dir_mode)
    # ".<name>.<pid>.<n>.tmp": the tier's index rebuild removes such files once they are stale
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{next(_TMP_SEQ)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, file_mode)
    try:
        try:
            os.write(fd, record)
            os.fsync(fd)  # once per namespace: cheap, and the record must outlive a power loss
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_record(root: str, namespace_id: str) -> None:
    try:
        os.unlink(os.path.join(root, chunkfile.record_relpath(namespace_id)))
    except FileNotFoundError:
        pass


def read_records(root: str) -> dict[str, bytes]:
    """Every record under the root, by namespace id (an unreadable one is logged and left out)."""
    directory = os.path.join(root, chunkfile.RECORDS_DIR)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    records = {}
    for name in names:
        namespace_id = chunkfile.parse_record_name(name)
        if namespace_id is None:
            continue
        try:
            with open(os.path.join(directory, name), "rb") as fh:
                records[namespace_id] = fh.read(chunkfile.MAX_RECORD_BYTES + 1)
        except OSError as exc:
            log.warning("cannot read namespace record %s: %s", os.path.join(directory, name), exc)
    return records
