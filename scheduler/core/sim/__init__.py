"""The discrete-event cluster simulator, its traces and the oracle bound (docs/simulator.md)."""

from __future__ import annotations

from scheduler.core.sim.hardware import HARDWARE, MODELS, HardwareSpec, ModelSpec
from scheduler.core.sim.latency import LatencyResult, decision_latency, synthetic_job
from scheduler.core.sim.oracle import OracleBound, oracle_bound
from scheduler.core.sim.perf import PerfModel, PerfParams
from scheduler.core.sim.results import MoveRecord, SimResult
from scheduler.core.sim.runner import build_simulation, job_params, profiles, simulate
from scheduler.core.sim.simulator import SimOptions, SimPolicy, Simulation, SimulationStalled
from scheduler.core.sim.trace import (
    Trace,
    TraceFormatError,
    TraceRecord,
    generate_trace,
    read_trace,
    read_trace_file,
    write_trace,
)
from scheduler.core.sim.workloads import (
    WORKLOADS,
    AgenticTurns,
    MathLengths,
    Workload,
    WorkloadKind,
    get_workload,
)

__all__ = [
    "HARDWARE",
    "MODELS",
    "WORKLOADS",
    "AgenticTurns",
    "HardwareSpec",
    "LatencyResult",
    "MathLengths",
    "ModelSpec",
    "MoveRecord",
    "OracleBound",
    "PerfModel",
    "PerfParams",
    "SimOptions",
    "SimPolicy",
    "SimResult",
    "Simulation",
    "SimulationStalled",
    "Trace",
    "TraceFormatError",
    "TraceRecord",
    "Workload",
    "WorkloadKind",
    "build_simulation",
    "decision_latency",
    "generate_trace",
    "get_workload",
    "job_params",
    "oracle_bound",
    "profiles",
    "read_trace",
    "read_trace_file",
    "simulate",
    "synthetic_job",
    "write_trace",
]
