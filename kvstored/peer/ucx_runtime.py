# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The process's one UCX context (ucxx allows one), shared by every UCX link and server.

ucxx is imported only here and only when a UCX transport starts: it is an optional dependency
(`pip install kvstored[ucx]`), and importing it sets UCX_* variables in the environment.
The context runs ucxx's own progress thread and its notifier thread, which completes request
futures on the event loop that initialised it (no busy polling on the loop). It is bound to that
loop: when the last user releases it, it is reset, so a later loop (a test's) can start anew.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import os
from dataclasses import dataclass
from types import ModuleType

from kvstored.peer.errors import TransportUnavailable

log = logging.getLogger(__name__)


def ucx_installed() -> bool:
    """Whether ucxx can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("ucxx") is not None
    except (ImportError, ValueError):
        return False


@dataclass
class _State:
    ucxx: ModuleType
    loop: asyncio.AbstractEventLoop
    options: dict[str, str]
    users: int = 0


_state: _State | None = None
_broken: str | None = None  # why UCX can no longer start in this process


def acquire(options: dict[str, str], connect_timeout_s: float) -> ModuleType:
    """The ucxx module, initialised for the running loop. Raises TransportUnavailable."""
    global _state
    loop = asyncio.get_running_loop()
    if _broken is not None:
        raise TransportUnavailable(_broken)
    if _state is not None:
        if _state.loop is not loop:
            if _state.users:
                raise TransportUnavailable("UCX is in use by another event loop in this process")
            _reset()
            if _broken is not None:
                raise TransportUnavailable(_broken)
        else:
            if options != _state.options:
                log.warning("UCX already started with options %s; ignoring %s", _state.options, options)
            _state.users += 1
            return _state.ucxx
    # UCX warns about variables ucxx sets for itself; ucxx warns when many requests start at once
    # (its futures pool refills on the next notifier round): neither is actionable.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCXX_LOG_LEVEL", "ERROR")
    try:
        import ucxx
    except ImportError as exc:
        raise TransportUnavailable(f"UCX transport needs ucxx (pip install 'kvstored[ucx]'): {exc}") from None
    try:
        ucxx.init(
            options=options,
            progress_mode="thread",
            enable_python_future=True,
            connect_timeout=connect_timeout_s,
        )
    except Exception as exc:  # UCXError, RuntimeError (already initiated elsewhere)...
        raise TransportUnavailable(f"cannot start UCX with {options}: {exc}") from None
    _state = _State(ucxx, loop, dict(options), users=1)
    return ucxx


def release() -> None:
    """One user less; the last one shuts the context down (its threads stop)."""
    if _state is None or _state.users <= 0:
        return
    _state.users -= 1
    if _state.users == 0:
        _reset()


def _reset() -> None:
    global _state, _broken
    state, _state = _state, None
    if state is None:
        return
    gc.collect()  # endpoints and listeners hold the context until collected
    try:
        # ucxx's notifier thread checks for its stop once a second; waking it now makes the stop
        # (and a daemon's shutdown) a second shorter. (A private attribute: without it, we wait.)
        state.ucxx.core._ctx.worker.stop_request_notifier_thread()
    except Exception:
        pass
    try:
        state.ucxx.reset()  # stops the notifier thread first
    except Exception as exc:  # something still holds an endpoint: the context can't be used again
        _broken = f"UCX could not be shut down cleanly and cannot start again in this process: {exc}"
        log.warning("%s", _broken)
