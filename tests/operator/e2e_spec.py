"""The tiny 2-node CPU PretrainJob spec the end-to-end tests start from."""

from __future__ import annotations

from typing import Any


def tiny_spec(steps: int = 8, **fault_tolerance: Any) -> dict[str, Any]:
    ft: dict[str, Any] = {
        # these tests show the gang recreated (test_e2e_inplace: the default, InPlace)
        "restartStrategy": "RecreateGang",
        "maxRestarts": 5,
        "backoff": {"initialSeconds": 1, "maxSeconds": 4},
        "heartbeat": {"startupTimeoutSeconds": 120, "timeoutSeconds": "auto"},
    }
    ft.update(fault_tolerance)
    return {
        "image": "hlat-trainer:dev",
        "nodes": 2,
        "instanceType": "cpu",
        "processesPerNode": 1,
        "model": {"preset": "tiny", "hiddenSize": 64, "layers": 2, "heads": 4, "kvHeads": 2,
                  "intermediateSize": 128, "maxSeqLen": 128},
        "precision": "fp32",
        "optimizer": {"lr": 3.0e-3, "minLr": 3.0e-4, "warmupSteps": 2},
        "data": {"path": "/fsx/data/sample", "tokenizer": "/fsx/data/sample/tokenizer.json",
                 "seqLen": 64},
        "train": {"globalBatch": 4, "microBatch": 2, "steps": steps},
        "checkpoint": {"dir": "/fsx/checkpoints", "interval": 2, "keep": 2, "async": False},
        "storage": {"claimName": "fsx", "mountPath": "/fsx"},
        "faultTolerance": ft,
    }
