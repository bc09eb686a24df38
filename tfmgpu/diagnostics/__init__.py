"""What this machine has, and how tfmgpu should train on it.

`collect()` describes the machine in a frozen `MachineReport` (software, GPUs,
CPU, cluster environment, logical devices). `recommend()` turns a report, and
nothing else, into `Recommendations`: a strategy, cross-device ops, a mixed
precision policy and the command line to start with, each with its reason.
Because recommendations depend only on the report, a report for a machine you
do not have (8 GPUs of compute capability 8.0, say) is a plain constructor
call away. `format_report` and `to_json` print both; `python -m
tfmgpu.doctor` is the command line.

Modules: `report` (the data), `probe` (`collect`), `recommendations`
(`recommend`), `formatting` (text and JSON).

Importing this package does not import TensorFlow; `collect()` does. It never
starts TensorFlow's runtime either, so a notebook can call it before
`tfmgpu.configure_devices(...)`.
"""

from tfmgpu.diagnostics.formatting import format_report
from tfmgpu.diagnostics.formatting import to_json
from tfmgpu.diagnostics.probe import collect
from tfmgpu.diagnostics.probe import summarize_tf_config
from tfmgpu.diagnostics.recommendations import Recommendation
from tfmgpu.diagnostics.recommendations import Recommendations
from tfmgpu.diagnostics.recommendations import recommend
from tfmgpu.diagnostics.report import CpuInfo
from tfmgpu.diagnostics.report import GpuInfo
from tfmgpu.diagnostics.report import MachineReport
from tfmgpu.diagnostics.report import TfConfigSummary

__all__ = [
    "CpuInfo",
    "GpuInfo",
    "MachineReport",
    "Recommendation",
    "Recommendations",
    "TfConfigSummary",
    "collect",
    "format_report",
    "recommend",
    "summarize_tf_config",
    "to_json",
]
