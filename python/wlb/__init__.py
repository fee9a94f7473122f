"""wlb: workload-balanced packing and context-parallel sharding for LLM training.

The planners of the wlb C++ project (docs/python.md): decks, length sources (generator
presets, text, JSONL and Megatron .idx files, or an in-memory array), the cost model, every
packer as a stateful, checkpointable object, the CP shard planner with per-rank token
indices and the KV communication plan, and the per-step metrics. Bad input raises
ValueError with the message the `wlb` command prints.

    import wlb
    deck = wlb.Deck("inputs/plan_smoke.toml", {"mesh.dp": 2})
    packer = wlb.Packer(deck)                      # packing.strategy, the deck's source
    plan = packer.pack()                           # step 0
    plan.micro_batch(0, 1)                         # [[doc, offset, length, arrival], ...]
    shard = wlb.ShardPlanner(deck, cp=2).plan(plan.micro_batch(0, 1))
    shard.token_index(1)                           # packed positions of CP rank 1's tokens

PyTorch integration: `wlb.torch` (BatchSampler, collate, Megatron dataset, context-parallel
attention over torch.distributed).
"""

from ._wlb import (  # noqa: F401
    CommPlan,
    ConservationChecker,
    CostModel,
    Deck,
    Documents,
    LengthSource,
    Packer,
    PackerCheckpoint,
    Plan,
    RunSummary,
    ShardPlan,
    ShardPlanner,
    compute_metrics,
    packer_names,
    preset_names,
    read_jsonl_lengths,
    read_megatron_idx,
    read_plan_file,
    read_text_lengths,
    sharding_names,
    write_megatron_idx,
)

__all__ = [
    "CommPlan",
    "ConservationChecker",
    "CostModel",
    "Deck",
    "Documents",
    "LengthSource",
    "Packer",
    "PackerCheckpoint",
    "Plan",
    "RunSummary",
    "ShardPlan",
    "ShardPlanner",
    "compute_metrics",
    "packer_names",
    "preset_names",
    "read_jsonl_lengths",
    "read_megatron_idx",
    "read_plan_file",
    "read_text_lengths",
    "sharding_names",
    "write_megatron_idx",
]
