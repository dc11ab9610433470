"""Expert placement: which rank of the expert-parallel axis holds which experts.

Experts are placed in contiguous blocks: rank ``r`` holds experts
``[r * experts_per_rank, (r + 1) * experts_per_rank)`` and calls them local experts
``0 .. experts_per_rank - 1`` in that order (the layout DeepEP, Megatron and MaxText use).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ep_comm.topology._checks import positive_int


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Contiguous placement of ``num_experts`` experts over ``num_ranks`` ranks."""

    num_experts: int
    num_ranks: int

    def __post_init__(self):
        positive_int("ExpertPlacement", "num_experts", self.num_experts)
        positive_int("ExpertPlacement", "num_ranks", self.num_ranks)
        if self.num_experts % self.num_ranks:
            raise ValueError(f"ExpertPlacement: num_experts={self.num_experts} must be divisible by "
                             f"the number of expert-parallel ranks {self.num_ranks}")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    def rank_of(self, expert_ids):
        """Rank holding each expert id (any integer array); meaningless for ids outside range."""
        return jnp.asarray(expert_ids) // self.experts_per_rank

    def local_index(self, expert_ids):
        """Index of each expert among its rank's local experts."""
        return jnp.asarray(expert_ids) % self.experts_per_rank
