"""Client for a tokentap rollout node (`tokentap serve`).

Submit tasks, wait for or stream their finished samples, and get each sample's trajectories
as dicts or NumPy arrays. The standard library only (urllib); NumPy when you ask for arrays.
Fully typed (PEP 561): the node's answers are described by the TypedDicts exported here.

    from tokentap_client import Node, group_advantages

    node = Node("http://127.0.0.1:8700", token="...")
    rollout = node.submit({...task spec...})
    for sample in node.wait(rollout["rollout_id"]):
        for trace in node.trajectories(sample, numpy=True):
            ...
"""

from .node import Node, NodeError
from .schema import (
    Cancelled,
    GateStatus,
    Outcome,
    Result,
    ResultsPage,
    Rollout,
    RolloutState,
    Sample,
    Submitted,
    Trace,
    TraceArrays,
    TraceCall,
    TrajectorySummary,
)
from .trajectories import as_arrays, group_advantages, groups, reward_of

__all__ = [
    "Node",
    "NodeError",
    "as_arrays",
    "group_advantages",
    "groups",
    "reward_of",
    # The shapes of the node's answers, for type checkers (plain dicts at run time).
    "Cancelled",
    "GateStatus",
    "Outcome",
    "Result",
    "ResultsPage",
    "Rollout",
    "RolloutState",
    "Sample",
    "Submitted",
    "Trace",
    "TraceArrays",
    "TraceCall",
    "TrajectorySummary",
]
