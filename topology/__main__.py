"""``python -m topology``: print the machine ep_comm plans with, and what the cost model predicts.

Options: ``--save FILE`` writes the topology as JSON (load it back with ``EP_COMM_TOPOLOGY=FILE``);
``--json`` prints JSON instead of the table; ``--simulate NxG`` plans for a simulated machine.
Under ``mpirun``, run it in every process (discovery is collective); process 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m topology", description=__doc__.split("\n")[0])
    p.add_argument("--simulate", metavar="NxG", help="plan for N nodes x G devices instead")
    p.add_argument("--save", metavar="FILE", help="write the topology as JSON")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)

    import jax

    from ep_comm import distributed
    distributed.initialize()
    import topology

    topo = topology.parse(args.simulate) if args.simulate else topology.current()
    if args.save and jax.process_index() == 0:
        topo.save(args.save)
    if jax.process_index() != 0:
        return 0
    n = topo.num_ranks
    plans = {}
    try:
        topo.gpus_per_node
        if args.experts % n == 0:
            model = topology.CostModel()
            for plan in topology.PLANS:
                t = topology.expected_traffic(num_experts=args.experts, topk=args.topk,
                                              tokens_per_rank=args.tokens, topology=topo,
                                              hidden=args.hidden, dtype=jax.numpy.dtype(args.dtype),
                                              plan=plan)
                plans[plan] = {"predicted_s": model.predict(t),
                               "network_bytes_per_rank": float(np.mean(t.network_bytes())),
                               "traffic": t.summary()}
    except ValueError as e:
        plans["note"] = str(e)
    if args.json:
        print(json.dumps({"topology": json.loads(topo.to_json()), "plans": plans}, indent=1))
        return 0
    print(topo)
    if "flat" in plans:
        print(f"\nuniform top-{args.topk} of {args.experts} experts, {args.tokens} tokens/rank, "
              f"hidden {args.hidden} {args.dtype}; cost model defaults (topology.CostModel):")
        print(f"{'plan':<13} {'network MB/rank':>16} {'dispatch us':>12} {'combine us':>11}")
        for plan in topology.PLANS:
            r = plans[plan]
            print(f"{plan:<13} {r['network_bytes_per_rank'] / 1e6:>16.2f} "
                  f"{r['predicted_s']['dispatch'] * 1e6:>12.1f} "
                  f"{r['predicted_s']['combine'] * 1e6:>11.1f}")
    elif "note" in plans:
        print(f"\n{plans['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
