"""XLA-native ragged all-to-all transport: ``jax.lax.ragged_all_to_all``.

Available where XLA implements the ``ragged-all-to-all`` HLO (GPU, TPU); XLA:CPU does not. It moves
exactly the rows requested. Its jvp, transpose and batching rules are JAX's own.
"""

from __future__ import annotations

from jax import lax


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, axis_index_groups=None, max_segment_rows=None,
                      label=None, tag=None):
    """Thin pass-through to ``lax.ragged_all_to_all``; arguments already validated.

    ``max_segment_rows``, ``label`` and ``tag`` are accepted for a uniform transport signature;
    this transport has no use for them."""
    del max_segment_rows, label, tag
    return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, axis_name=axis_name,
                                 axis_index_groups=axis_index_groups)

