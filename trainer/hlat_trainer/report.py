"""Where per-step numbers go: one JSON object per line on stdout, or a progress bar.

JSON keys are camelCase like the rest of the API (`step`, `loss`, `lr`, `gradNorm`,
`tokensPerSecond`, ...), so log scrapers, the demo and the tests read the same names.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from pydantic.alias_generators import to_camel
from tqdm import tqdm

_SKIP = {"tokens_step"}


def to_record(stats: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in stats.items():
        if key not in _SKIP:
            out[to_camel(key)] = value  # floats in full: resumed runs are compared bit for bit
    return out


class JsonLines:
    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self.stream = stream

    def __call__(self, stats: dict[str, Any]) -> None:
        self.stream.write(json.dumps(to_record(stats)) + "\n")
        self.stream.flush()


class ProgressBar:
    def __init__(self, total: int, initial: int = 0) -> None:
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def __call__(self, stats: dict[str, Any]) -> None:
        self.bar.n = stats["step"]
        self.bar.set_postfix(
            loss=f"{stats['loss']:.4f}", tok_s=f"{stats['tokens_per_second']:,.0f}",
            lr=f"{stats['lr']:.2e}", refresh=False,
        )
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
