"""Float64 numpy model of dispatch/combine (what ep_comm promises, written the slow, obvious way)
and routing generators shared by the MoE tests."""

from __future__ import annotations

import numpy as np

from ep_comm.benchmarks.reference import dense_swiglu_moe  # noqa: F401 (the tests' dense layer)


def routing(rng, kind, n, T, K, E):
    """Global ``(n*T, K)`` expert ids for a routing pattern; -1 means no expert."""
    if kind == "random":  # distinct experts per token, like a real top-k router
        ids = np.argsort(rng.random((n * T, E)), axis=1)[:, :K]
    elif kind == "skewed":  # expert popularity falls off as 1 / (e + 1)^0.8; distinct per token
        logits = rng.gumbel(size=(n * T, E)) - 0.8 * np.log1p(np.arange(E))[None, :]
        ids = np.argsort(-logits, axis=1)[:, :K]
    elif kind == "masked":
        ids = np.argsort(rng.random((n * T, E)), axis=1)[:, :K]
        ids[rng.random((n * T, K)) < 0.4] = -1
    elif kind == "one_expert":  # every token to expert 0 (and nothing else)
        ids = np.full((n * T, K), -1)
        ids[:, 0] = 0
    elif kind == "one_rank":  # every token's experts all on the last rank
        L = E // n
        ids = (n - 1) * L + rng.integers(0, L, (n * T, K))
    elif kind == "empty_ranks":  # even ranks send nothing; nobody routes to odd ranks' experts
        L = E // n
        even_experts = np.concatenate([np.arange(r * L, (r + 1) * L) for r in range(0, n, 2)])
        ids = rng.choice(even_experts, (n * T, K))
        for r in range(0, n, 2):
            ids[r * T:(r + 1) * T] = -1
    else:
        raise ValueError(kind)
    return ids.astype(np.int32)


class Reference:
    """Receive-side layout of dispatch for global inputs; per-rank results."""

    def __init__(self, ids, n, E, T, C, R):
        K = ids.shape[1]
        L = E // n
        self.n, self.E, self.T, self.K, self.L, self.C = n, E, T, K, L, C
        self.kept = np.zeros(ids.shape, bool)  # (token, k) pairs that reached an expert row
        self.rows = []  # per rank: list of (token, k) for each expert_x row, grouped by local expert
        self.group_sizes = np.zeros((n, L), np.int64)
        self.dropped = np.zeros(n, np.int64)
        valid = (ids >= 0) & (ids < E)
        for d in range(n):
            toks = [tok for tok in range(n * T) if np.any(valid[tok] & (ids[tok] // L == d))][:R]
            # a token listing one expert twice needs one row (its weights add up in combine)
            pairs = [(ids[tok, k] % L, i, k, tok) for i, tok in enumerate(toks) for k in range(K)
                     if valid[tok, k] and ids[tok, k] // L == d and ids[tok, k] not in ids[tok, :k]]
            pairs.sort()
            placed = pairs[:C]
            self.rows.append([(tok, k) for _, _, k, tok in placed])
            for l, _, k, tok in placed:
                self.group_sizes[d, l] += 1
                self.kept[tok, ids[tok] == ids[tok, k]] = True
            distinct = sum(len({e for e in ids[tok] if 0 <= e < E and e // L == d})
                           for tok in range(n * T))
            self.dropped[d] = distinct - len(placed)
        self.invalid = np.sum((ids != -1) & ~valid)

    def expert_x(self, x, zero_fill=False):
        """Per rank ``(C, H)``: the groups' rows, then ``ZERO_TAIL_ROWS`` zero rows, then NaN (the
        unspecified rows, as the XLA path poisons them) or, with ``zero_fill``, zeros."""
        from ep_comm.expand import ZERO_TAIL_ROWS

        out = np.zeros((self.n, self.C, x.shape[1]), np.float64)
        for d, rows in enumerate(self.rows):
            if not zero_fill:
                out[d, len(rows) + ZERO_TAIL_ROWS:] = np.nan
            for r, (tok, _) in enumerate(rows):
                out[d, r] = x[tok]
        return out

    def combine(self, x, ids, w, W=None):
        """``y[t] = sum_k kept * w[t, k] * expert(x[t])`` in float64; identity experts when
        ``W`` is None, else ``x[t] @ W[expert]``."""
        xs = np.asarray(x, np.float64)
        y = 0.0
        for k in range(self.K):
            e = np.clip(ids[:, k], 0, self.E - 1)
            v = xs if W is None else np.einsum("th,thf->tf", xs, np.asarray(W, np.float64)[e])
            # a slot that reached no expert adds exactly nothing (even for NaN or Inf activations)
            y = y + np.where(self.kept[:, k, None], np.asarray(w[:, k, None], np.float64) * v, 0.0)
        return y


def dense_moe(x, ids, w, W):
    """Single-device dense MoE in float32 (jax, differentiable): ``sum_k w[:, k] * x @ W[ids[:, k]]``
    over the slots with ``ids >= 0``."""
    import jax.numpy as jnp

    E = W.shape[0]
    out = 0.0
    for k in range(ids.shape[1]):
        e = jnp.clip(ids[:, k], 0, E - 1)
        out = out + jnp.where(ids[:, k:k + 1] >= 0, w[:, k:k + 1], 0.0) * \
            jnp.einsum("th,thf->tf", x, W[e])
    return out


def check_nnx_against_dense(module, x, cot, y, grads, topk):
    """The NNX MoE ``module``'s output ``y`` on ``x`` and its parameter gradients ``grads`` (of
    ``sum(y * cot)``) against the same parameters run densely in float64 on one device."""
    import jax
    import jax.numpy as jnp
    from ep_comm.nnx import route

    H = x.shape[-1]
    names = ("router", "w_in", "w_out", "shared_w_in", "shared_w_out")
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a), jnp.float64)  # noqa: E731
        params = {k: f64(getattr(module, k)[...]) for k in names}

        def loss(p):
            t = f64(x).reshape(-1, H)
            ids, w = route(t, p["router"], topk)
            out = dense_swiglu_moe(t, ids, w, p["w_in"], p["w_out"], p["shared_w_in"],
                                   p["shared_w_out"])
            return jnp.sum(out * f64(cot).reshape(-1, H)), out
        want_grads, want = jax.grad(loss, has_aux=True)(params)
    assert y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y).reshape(-1, H), want, rtol=2e-5, atol=2e-5)
    for k in names:
        r = np.asarray(want_grads[k])
        np.testing.assert_allclose(np.asarray(getattr(grads, k)[...]), r, rtol=2e-5,
                                   atol=2e-5 * (1 + np.abs(r).max()), err_msg=k)


def hits_mean_sd(E, K, sizes):
    """Mean and standard deviation of how many of the disjoint expert sets of the given ``sizes``
    a token hits when it picks ``K`` distinct experts of ``E`` uniformly (the ``random`` routing):
    a set of ``s`` experts is missed with probability ``C(E - s, K) / C(E, K)``, two sets together
    with that of their union, which gives the second moment exactly."""
    from math import comb, sqrt

    miss = lambda s: comb(E - s, K) / comb(E, K)  # noqa: E731
    mean = sum(1 - miss(s) for s in sizes)
    both = sum(1 - miss(a) - miss(b) + miss(a + b)
               for i, a in enumerate(sizes) for j, b in enumerate(sizes) if i != j)
    return mean, sqrt(max(mean + both - mean * mean, 0.0))
