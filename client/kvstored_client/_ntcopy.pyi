from typing import Any

STREAMING: int

def copy(dst: Any, src: Any) -> None: ...
