"""Typed shapes of the node's JSON answers (see its /openapi.json and `tokentap schema --trace`).

These are `TypedDict`s: at run time every value is a plain dict, as `json.loads` made it; the
classes only tell a type checker which keys there are. Keys a node may leave out (or that a
later node version adds) are in the `total=False` part of each shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, TypedDict

if TYPE_CHECKING:  # NumPy is optional: only a type checker looks at the array types.
    import numpy as np
    import numpy.typing as npt

Stage = Literal["queued", "init", "run", "post_run", "done"]
"""Where a sample is in the node's pipeline."""

OutcomeStatus = Literal["completed", "timeout", "error", "cancelled"]


class Submitted(TypedDict):
    """What `Node.submit` returns: the rollout's id and its samples' ids, in index order."""

    rollout_id: str
    samples: List[str]


class _OutcomeBase(TypedDict):
    status: OutcomeStatus


class Outcome(_OutcomeBase, total=False):
    """How a sample ended. `reward` with "completed" and "timeout" (0 then), `reason` with
    "timeout" and "error"; "cancelled" has neither."""

    reward: float
    reason: str


class _AgentReportBase(TypedDict):
    exit_code: Optional[int]  # None: killed (budget, cancel) or died of a signal
    timed_out: bool
    duration_ms: int
    oom_killed: bool
    pids_limit_hit: bool  # a fork was refused at the process limit


class AgentReport(_AgentReportBase, total=False):
    """How a sample's agent ran (`peak_memory_bytes` when it had limits)."""

    peak_memory_bytes: int


class TrajectorySummary(TypedDict):
    """What a sample's captured calls became (its traces are at `Node.traces`)."""

    path: str
    session_id: str
    calls: int
    traces: int
    trainable_tokens: int
    faithfulness_violations: int
    complete: bool


class _EvaluationBase(TypedDict):
    reward: float


class Evaluation(_EvaluationBase, total=False):
    """What the evaluator found: `exit_code` and `log` from the command evaluator,
    `passed`/`failed` from swebench, `trace_rewards` when it rewarded traces one by one."""

    trace_rewards: Dict[str, float]
    passed: List[str]
    failed: List[str]
    exit_code: int
    log: str


class _CallbackStatusBase(TypedDict):
    delivered: bool
    attempts: int


class CallbackStatus(_CallbackStatusBase, total=False):
    """How the delivery to the rollout's `callback_url` ended (`error`: why it gave up)."""

    error: str


class _SampleBase(TypedDict):
    sample_id: str
    rollout_id: str
    index: int
    stage: Stage
    stage_started_ms: List[int]
    attempt: int
    task_id: str
    stage_ended_ms: List[int]
    outcome: Optional[Outcome]
    trajectory: Optional[TrajectorySummary]
    evaluation: Optional[Evaluation]


class Sample(_SampleBase, total=False):
    """One sample of a rollout, as the node stores it. `task_id` is its GRPO group;
    `outcome` is None until it ended; `agent` is there once its agent ran, `callback` once a
    result was delivered to the rollout's callback URL. `_cursor` is set only on samples from
    `Node.stream`."""

    agent: AgentReport
    callback: CallbackStatus
    _cursor: int


class Rollout(TypedDict):
    """A submitted task as the node keeps it (`spec` is the task spec with its defaults)."""

    rollout_id: str
    spec: Dict[str, Any]
    submitted_ms: int
    cancelled: bool


class RolloutState(TypedDict):
    """What `Node.rollout` returns."""

    rollout: Rollout
    status: Literal["running", "done"]
    samples: List[Sample]


class Cancelled(TypedDict):
    """What `Node.cancel` returns: how many of its samples were running (their agents are
    killed; queued ones ended at once)."""

    rollout_id: str
    stopping: int


class Result(TypedDict):
    """One item of a results page: a finished sample and its cursor."""

    cursor: int
    sample: Sample


class ResultsPage(TypedDict):
    """`GET /v1/results`: `next` is the cursor to pass as `after` for the next page."""

    results: List[Result]
    next: int


class GateStatus(TypedDict):
    """What `Node.pause` and `Node.resume` return."""

    paused: bool
    in_flight: int
    policy_version: Optional[str]


class _TraceCallBase(TypedDict):
    record_id: str
    response_start: int
    sampled_len: int
    trainable: bool


class TraceCall(_TraceCallBase, total=False):
    """One model call merged into a trace."""

    finish_reason: Optional[str]
    policy_version: Optional[str]
    # `--engine-weight-version`: the engine's weight version when the call ended, and whether
    # it changed while the call ran.
    engine_weight_version: Optional[str]
    straddles_weight_update: bool


class _TraceBase(TypedDict):
    schema_version: int
    trace_id: str
    session_id: str
    strategy: str
    index: int
    started_by: str
    prompt_ids: List[int]
    response_ids: List[int]
    loss_mask: List[int]
    logprobs: List[float]
    calls: List[TraceCall]
    spans_policy_versions: bool
    messages_json: str
    tools_json: str


class Trace(_TraceBase, total=False):
    """A trace row (`tokentap schema --trace`): `response_ids`, `loss_mask` and `logprobs`
    are aligned (one entry per response token); `loss_mask` is 1 where the model sampled the
    token."""

    reward: Optional[float]
    group_id: Optional[str]
    gaps: List[str]
    # `--token-mode tito`: why tito rendered the trace's first call whole (`first`, `edited`,
    # `compacted`, ...); None when it extended an earlier call or was not built in tito.
    tito_branch: Optional[str]
    # The engine reported more than one weight version for the calls, or a call straddled an
    # update.
    spans_engine_weight_versions: bool


class TraceArrays(TypedDict):
    """A trace as NumPy arrays (`as_arrays`, `Node.trajectories(..., numpy=True)`):
    `input_ids` and `loss_mask` span prompt and response; `logprobs` spans the response only,
    which starts at `input_ids[response_start]`."""

    input_ids: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.int8]
    logprobs: npt.NDArray[np.float32]
    response_start: int
    reward: Optional[float]
    group_id: Optional[str]
    trace_id: Optional[str]
    session_id: Optional[str]
