"""Client for a tokentap rollout node (`tokentap serve`).

Submit tasks, wait for or stream their finished samples, and get each sample's trajectories
as dicts or NumPy arrays. The standard library only (urllib); NumPy when you ask for arrays.

    from tokentap_client import Node, group_advantages

    node = Node("http://127.0.0.1:8700", token="...")
    rollout = node.submit({...task spec...})
    for sample in node.wait(rollout["rollout_id"]):
        for trace in node.trajectories(sample, numpy=True):
            ...
"""

from .node import Node, NodeError
from .trajectories import as_arrays, group_advantages, groups, reward_of

__all__ = ["Node", "NodeError", "as_arrays", "group_advantages", "groups", "reward_of"]
