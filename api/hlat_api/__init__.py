"""hlat_api: the contract the operator and the trainer share.

The PretrainJob spec and status models, the environment-variable names, the heartbeat
protocol and the checkpoint layout. It imports neither torch nor kopf nor the Kubernetes
client (an import-linter contract keeps it so), so both sides can depend on it cheaply.
"""

from hlat_api.env import Env, ExitCode
from hlat_api.errors import SpecError
from hlat_api.heartbeat import Heartbeat, lease_name
from hlat_api.layout import CheckpointEntry, latest_complete, list_checkpoints, step_dir
from hlat_api.manifest import InvalidSpecError, Job, apply_overrides, load_job, parse_spec
from hlat_api.presets import INSTANCE_TYPES, MODEL_PRESETS, InstanceInfo, ModelDims
from hlat_api.spec import PretrainJobSpec
from hlat_api.status import PretrainJobStatus

__all__ = [
    "INSTANCE_TYPES",
    "MODEL_PRESETS",
    "CheckpointEntry",
    "Env",
    "ExitCode",
    "Heartbeat",
    "InstanceInfo",
    "InvalidSpecError",
    "Job",
    "ModelDims",
    "PretrainJobSpec",
    "PretrainJobStatus",
    "SpecError",
    "apply_overrides",
    "latest_complete",
    "lease_name",
    "list_checkpoints",
    "load_job",
    "parse_spec",
    "step_dir",
]
