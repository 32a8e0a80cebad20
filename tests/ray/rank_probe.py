"""A worker extension that tells each data-parallel rank apart: its process (to kill it)
and how many forward passes its model ran (to see that it served). Loaded by
`--worker-extension-cls tests.ray.rank_probe:RankProbe`; read with `/collective_rpc`."""

from __future__ import annotations

import os
from typing import Any


class RankProbe:
    def __init__(self) -> None:
        self.forwards = 0
        model = self.model_runner.model  # type: ignore[attr-defined]  # set by the engine
        forward = model.forward

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.forwards += 1
            return forward(*args, **kwargs)

        model.forward = counted

    def probe(self) -> dict[str, int]:
        return {"rank": self.rank, "pid": os.getpid(), "forwards": self.forwards}  # type: ignore[attr-defined]
