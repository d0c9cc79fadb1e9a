"""A second policy, written from the public description of DeepSeek's EPLB (deepseek-ai/EPLB),
to compare with FlowServe's on the same counts.

DeepSeek's EPLB balances the load summed over the whole history (no time slices):
- replicate: each extra replica goes to the expert with the highest load per replica;
- hierarchical: replicas are first spread over nodes (servers) so every node's load is even, then
  over the dies of a node; global: straight over all dies (it is the hierarchical one with a
  single node);
- pack: heaviest physical replica first, to the least-loaded die that has room.
Difference kept on purpose: DeepSeek's EPLB may also move the primary experts; here the routed
slots stay as the topology placed them (only redundant slots change, as in FlowServe), so a
reconfiguration never has to empty a routed slot.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.eplb.placement import Placement


def replicate(load: np.ndarray, num_replicas: np.ndarray, budget: int) -> list[int]:
    """Experts that get an extra replica, in order: highest load per replica first.

    load: [num_experts] tokens over the history; num_replicas: [num_experts] replicas now."""
    num_replicas = num_replicas.astype(np.int64).copy()
    chosen = []
    for _ in range(budget):
        expert = int(np.argmax(load / np.maximum(num_replicas, 1)))  # ties: lowest index
        chosen.append(expert)
        num_replicas[expert] += 1
    return chosen


def place(
    placement: Placement, layer: int, load: np.ndarray, chosen: list[int], dies_per_node: int
) -> tuple[int, ...]:
    """New phy2log row: pack the chosen replicas node by node, then die by die.

    load: [num_experts]. dies_per_node: dies of one server (a node of DeepSeek's hierarchy)."""
    row = [-1 if placement.is_redundant[s] else e for s, e in enumerate(placement.phy2log[layer])]
    num_replicas = np.bincount([e for e in row if e >= 0], minlength=placement.num_experts)
    num_replicas = num_replicas + np.bincount(chosen, minlength=placement.num_experts)
    per_replica = load / np.maximum(num_replicas, 1)  # [E]
    die_load = np.zeros(placement.num_dies)
    for slot, expert in enumerate(row):
        if expert >= 0:
            die_load[placement.slot_die[slot]] += per_replica[expert]
    free = {d: list(placement.redundant_slots(d)) for d in range(placement.num_dies)}
    for expert in sorted(chosen, key=lambda e: (-per_replica[e], e)):
        open_dies = [d for d, slots in free.items() if slots]
        node_load = {
            d // dies_per_node: die_load[d // dies_per_node * dies_per_node :][:dies_per_node].sum()
            for d in open_dies
        }
        node = min(node_load, key=lambda n: (node_load[n], n))
        die = min(
            (d for d in open_dies if d // dies_per_node == node), key=lambda d: (die_load[d], d)
        )
        row[free[die].pop(0)] = expert
        die_load[die] += per_replica[expert]
    return tuple(row)


def rebalance(
    placement: Placement, counts: np.ndarray, budget: int, *, dies_per_node: int
) -> Placement:
    """Every layer. counts: [num_layers, num_slices, num_experts] (the slices are summed)."""
    for layer in range(len(placement.phy2log)):
        load = np.asarray(counts[layer], np.float64).sum(axis=0)
        routed = [  # a die lost to vertical scaling leaves fixed empty slots (-1)
            e
            for s, e in enumerate(placement.phy2log[layer])
            if not placement.is_redundant[s] and e >= 0
        ]
        base = np.bincount(routed, minlength=placement.num_experts)
        chosen = replicate(load, base, budget)
        row = place(placement, layer, load, chosen, dies_per_node)
        placement = placement.with_layer(layer, row)
    return placement
