"""``python -m ep_comm.topology``: print the machine ep_comm plans with, and what the cost model predicts.

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
    p = argparse.ArgumentParser(prog="python -m ep_comm.topology", description=__doc__.split("\n")[0])
    p.add_argument("--simulate", metavar="NxG", help="plan for N nodes x G devices instead")
    p.add_argument("--save", metavar="FILE", help="write the topology as JSON")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sample", action="store_true",
                   help="also count a drawn routing: uniform top-k, and node-limited top-k "
                        "(DeepSeek-V3 group-limited, --max-nodes) on random scores")
    p.add_argument("--max-nodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import jax

    from ep_comm import topology
    from ep_comm.topology.processes import initialize
    initialize()

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
                net = float(np.mean(t.network_bytes("dispatch")))
                plans[plan] = {"predicted_s": model.predict(t), "network_bytes_per_rank": net,
                               "traffic": t.summary()}
            if args.sample:
                plans["sampled"] = sampled(topo, args, model)
    except ValueError as e:
        plans["note"] = str(e)
    if args.json:
        print(json.dumps({"topology": json.loads(topo.to_json()), "plans": plans}, indent=1))
        return 0
    print(topo)
    if "flat" in plans:
        print(f"\nuniform top-{args.topk} of {args.experts} experts, {args.tokens} tokens/rank, "
              f"hidden {args.hidden} {args.dtype}; cost model defaults (topology.CostModel):")
        print(f"{'plan':<13} {'network MB/rank (dispatch)':>27} {'dispatch us':>12} "
              f"{'combine us':>11}")
        for plan in topology.PLANS:
            r = plans[plan]
            print(f"{plan:<13} {r['network_bytes_per_rank'] / 1e6:>27.2f} "
                  f"{r['predicted_s']['dispatch'] * 1e6:>12.1f} "
                  f"{r['predicted_s']['combine'] * 1e6:>11.1f}")
    elif "note" in plans:
        print(f"\n{plans['note']}")
    if "sampled" in plans:
        print(f"\ndrawn routing (seed {args.seed}), network rows per token and bytes of the "
              f"busiest rank (dispatch), predicted dispatch + combine:")
        print(f"{'routing':<22} {'plan':<13} {'rows/token':>10} {'MB busiest':>11} "
              f"{'model us':>9}")
        for name, per in plans["sampled"].items():
            for plan, r in per.items():
                print(f"{name:<22} {plan:<13} {r['network_rows_per_token']:>10.3f} "
                      f"{r['network_bytes_max'] / 1e6:>11.2f} {r['predicted_s'] * 1e6:>9.1f}")
    return 0


def sampled(topo, args, model) -> dict:
    """Count the traffic of drawn routings (numpy; the router runs on the default device)."""
    import jax.numpy as jnp

    from ep_comm import topology
    n, T, E, K = topo.num_ranks, args.tokens, args.experts, args.topk
    rng = np.random.default_rng(args.seed)
    scores = rng.random((n * T, E), dtype=np.float32)
    routings = {f"uniform top-{K}": np.argsort(-scores, axis=1)[:, :K]}
    M = min(args.max_nodes, topo.num_nodes)
    if M < topo.num_nodes:
        r = topology.node_limited_topk(jnp.asarray(scores), K, num_nodes=topo.num_nodes,
                                       max_nodes=M)
        routings[f"node-limited M={M}"] = np.asarray(r.topk_ids)
    net = topology.LINK_CLASSES.index("network")
    out = {}
    for name, ids in routings.items():
        out[name] = {}
        for plan in topology.PLANS:
            t = topology.count_traffic(ids.reshape(n, T, K), num_experts=E, topology=topo,
                                       hidden=args.hidden, dtype=jnp.dtype(args.dtype), plan=plan)
            rows = t.rows_by_link("dispatch")[:, net]
            out[name][plan] = dict(network_rows_per_token=float(rows.sum() / (n * T)),
                                   network_bytes_max=float(t.network_bytes("dispatch").max()),
                                   predicted_s=model.predict(t)["total"])
    return out


if __name__ == "__main__":
    sys.exit(main())
