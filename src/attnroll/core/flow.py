"""Attention flow (Abnar & Zuidema, 2020): the maximum flow from an output token to each input token.

The graph has a node (l, i) for every layer l = 0..L' (layer 0 holds the inputs) and token i; an edge runs
from (l, i) down to (l−1, k) with capacity Ã_l[i, k], the residual-augmented attention of layer l exactly as
``rollout`` builds it. For output row r the source is (L', r); each input node (0, j) is in turn the sink,
and the result is that max-flow value.

How it is computed (exactly, and fast)
--------------------------------------
The reference code runs one float max-flow per (output, input) pair in networkx. Here every value is a
max flow of an *integer* graph solved by scipy's compiled Dinic (``scipy.sparse.csgraph.maximum_flow``),
certified by a minimum cut:

* Capacities are scaled by a power of two ``S`` (as large as int32 allows: S·max capacity < 2³¹, so S = 2³¹
  for the usual capacities < 1) and floored; the floored graph is a sub-capacity graph of the real one.
* One graph per (example, output), built once. The layer-1 → input edges that lead to other inputs are
  dead ends for a given sink and never enter it; zero-capacity edges are dropped; nodes the source cannot
  reach, or that reach no input, are pruned.
* Certified subgraphs (edge generation). Each input j is first solved on a small subgraph: the 3 largest
  edges of every row and every column, the diagonal (residual) edges, the source token's row, input j's
  whole column (flow to one input converges on its own token through many small edges), and every edge
  learned so far. Its flow is a lower bound. Upper bounds come from a pool of cuts — a cut is a node set,
  so every cut ever certified bounds *every* input's flow, besides the source cut, the sink cut and the
  two-layer cut. Flow == pooled bound: certified. Otherwise the source side R of the subgraph's minimum
  cut is measured in the whole graph: if no edge of positive capacity that the subgraph lacks leaves R,
  R is a whole-graph cut equal to the flow (max-flow/min-cut) — certified, and pooled. Else the missing
  crossing edges are added and j is solved again; when there are too many (more than n), j is solved once
  on the whole graph, whose cut is pooled and whose flow's edges join the subgraph. The result is always
  the whole integer graph's max flow, identical to running Dinic on it.
* Several inputs per solver call: one disjoint copy of the subgraph per input, all fed from one
  super-source and drained into one super-sink. Copies share no node but those two, so the union's max
  flow restricted to a copy is that copy's max flow (exact), and scipy's ~1 ms fixed cost per call is
  shared. The number of inputs per call doubles while every input certifies at once and halves when not.
* What is *not* done: reading all inputs' values off one flow to a super-sink joined to every input.
  Per-input max flows compete for the same capacity, so such a flow undercounts (it is not exact). The
  only closed form used is the provably exact one: with one layer the flow is Ã[r, j] (the only path).
* ``n_jobs`` > 1 runs (example, output, block of inputs) tasks in worker processes (scipy's solver holds
  the GIL, so threads do not help).

Error bound (absolute, per value, before ``normalize``)
-------------------------------------------------------
Let F be the true max flow and F' the integer max flow of the floored graph. Flooring only lowers
capacities, so F'/S ≤ F; any cut's real capacity bounds F from above, so F ≤ U := the smallest real
capacity among the pooled cuts (which include the certified minimum cut C of F'). The value returned is U,
and F ∈ [F'/S, U] with U − F'/S < (number of edges crossing C)/S, since a floored edge loses less than
1/S = 2⁻³¹ ≈ 4.7e-10: about n·2.3e-10 for the usual source or sink cut (1.3e-7 at n = 577). When the
measured gap U − F'/S exceeds ``GAP_TOL`` = 5e-7, the residual problem (real capacities minus the integer
flow, clipped at the gap, which cannot change its max flow) is solved again at the scale 2³⁰/gap and
certified by its own minimum cut, shrinking the gap by another factor ~(cut edges)·2⁻²⁹. So every raw value
is within 5e-7 of the exact max flow (a RuntimeWarning says so otherwise; never seen), and typically within
1e-9 or exactly equal (when C is also the real graph's minimum cut, U is F up to float rounding).

Capacities of any magnitude: each example's capacities are first scaled by the power of two 2^-e that
brings the largest into (0.5, 1] (exact; e = 0 for attention probabilities with the default residual) and
the flows scaled back by 2^e, so the bounds above hold relative to the largest capacity (rounded up to a
power of two).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import _checks
from .rollout import augmented_layers, layer_range, parse_attentions, parse_rows

#: Largest int32 capacity scipy's max-flow solver accepts (its capacities are int32; flow totals are not).
_INT32_MAX = 2**31 - 1
#: A value whose certified gap (upper bound − lower bound) exceeds this is refined by a second solve.
GAP_TOL = 5e-7
#: Largest edges per row and per column kept in the initial subgraph of every layer (besides the diagonal,
#: the source token's row and each input's column).
_K_BASE = 3
#: Rounds of edge generation for one input before the whole graph is solved instead.
_MAX_ROUNDS = 3
#: At most this many times n missing edges are added across a cut; beyond, the whole graph is solved.
_GROW_LIMIT = 1
#: Edges per solver call when several inputs are solved at once as disjoint copies (amortises the
#: solver's fixed per-call cost, ~1 ms, over many small graphs).
_BATCH_EDGES = 200_000
#: Below this much work (layers x tokens³ summed over problems, ~0.25 s) n_jobs is ignored: starting
#: worker processes costs ~0.1 s.
_PARALLEL_WORK = 30_000_000
#: Rough bytes per potential edge at peak: dense per-layer arrays (real 8, int 8, masks 2), the column
#: index (4) plus scipy's solver arrays when the subgraph grows into the whole graph (capacities, indices,
#: reverse edges, edge pointers, flows and transposes: ~40). Measured: 127 MiB at n = 577, L' = 12.
_BYTES_PER_EDGE = 62
#: Bytes per entry of the dense capacities built for the whole batch before any graph: the augmented
#: layers (up to 8) and their float64 stack (8).
_BYTES_DENSE = 16


# ------------------------------------------------------------------------------------------- the solver
class _RowSolver:
    """All max flows from one source (output row) to every input of one example.

    ``caps`` is the (L', m, m) stack of augmented layers, oldest first: ``caps[0]`` holds the edges from
    layer 1 down to the inputs, ``caps[-1]`` the edges leaving the top layer, whose row ``source`` is the
    source node. Node (l, i) of layers 1..L' has id (l−1)·m + i in cut and edge bookkeeping.
    """

    def __init__(self, caps: np.ndarray, source: int, k_base: int = _K_BASE, batch_edges: int = _BATCH_EDGES) -> None:
        self.L, self.m = caps.shape[0], caps.shape[1]
        L, m = self.L, self.m
        self.source = source
        self.batch_edges = batch_edges
        positive = caps > 0
        # Prune: keep (l, i) only if the source reaches it and it reaches some input (both along
        # positive-capacity edges); other nodes carry no flow to any sink.
        reach = [np.zeros(m, bool) for _ in range(L + 1)]  # reach[l] for layer l = 0..L
        reach[L][source] = True
        for l in range(L, 0, -1):
            reach[l - 1] = reach[l].astype(np.int32) @ positive[l - 1] > 0
        co = [np.ones(m, bool) for _ in range(L + 1)]
        for l in range(1, L + 1):
            co[l] = positive[l - 1] @ co[l - 1].astype(np.int32) > 0
        self.keep = [reach[l] & co[l] for l in range(L + 1)]
        self.keep[0] = np.ones(m, bool)  # inputs: all are sinks (an unreachable one just gets 0)
        real = [caps[l - 1] * np.outer(self.keep[l], self.keep[l - 1]) for l in range(1, L + 1)]
        self.real = real  # real[l-1]: kept edges from layer l down to layer l-1
        top = max(float(r.max()) for r in real)
        self.empty = top <= 0.0
        # The largest power of two that keeps every floored capacity within int32.
        self.scale = 2.0 ** math.floor(math.log2(_INT32_MAX / top)) if top > 0 else 1.0
        self.ints = [np.floor(r * self.scale).astype(np.int64) for r in real]
        self.sub: list[Any] = [None] + [self._base_mask(l, k_base) for l in range(2, L + 1)]
        # The subgraph's internal edges (rebuilt on growth) and the whole graph's (built on first need).
        self._shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._shared_full: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._cols: list[tuple[np.ndarray, np.ndarray]] | None = None  # per layer: missing edges by column
        #: Counters for benchmarks: solver calls, inputs solved on the subgraph / whole graph, cuts measured,
        #: edges generated.
        self.stats = {"calls": 0, "sub": 0, "full": 0, "cuts": 0, "added": 0}
        # Upper bounds for every sink from known cuts: the source cut and the sink / two-layer cut.
        self.ub_int = np.full(m, np.iinfo(np.int64).max, dtype=np.int64)
        self.ub_real = np.full(m, np.inf)
        if L >= 2:
            self._add_cut([np.zeros(m, bool) for _ in range(L - 1)] + [self._only_source()])  # {s}
            self._add_cut([self.keep[l].copy() for l in range(1, L)] + [self._only_source()])  # all but the sink

    def _only_source(self) -> np.ndarray:
        mask = np.zeros(self.m, bool)
        mask[self.source] = True
        return mask

    def _base_mask(self, l: int, k: int) -> np.ndarray:
        """The initial subgraph of layer l: the k largest edges of each row and each column, the diagonal
        (the residual edges) and the source token's row, restricted to positive integer capacity."""
        w = self.ints[l - 1]
        m = self.m
        if k >= m:
            return w > 0
        mask = np.zeros((m, m), bool)
        if k > 0:
            idx = np.argpartition(-w, k - 1, axis=1)[:, :k]
            np.put_along_axis(mask, idx, True, axis=1)
            idx = np.argpartition(-w, k - 1, axis=0)[:k, :]
            np.put_along_axis(mask, idx, True, axis=0)
        mask[np.arange(m), np.arange(m)] = True
        mask[self.source] = True  # flow leaves the source token through many small edges
        return mask & (w > 0)

    # graphs ---------------------------------------------------------------------------------------------
    def _internal(self, full: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Edges among layers 1..L'−1 (tails in layers 2..L'−1) of the subgraph or the whole graph, as
        (tail ids, head ids, int capacities)."""
        cached = self._shared_full if full else self._shared
        if cached is not None:
            return cached
        m = self.m
        rows, cols, data = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for l in range(2, self.L):
            mask = self.ints[l - 1] > 0 if full else self.sub[l - 1]
            ii, kk = np.nonzero(mask)
            rows.append((l - 1) * m + ii)
            cols.append((l - 2) * m + kk)
            data.append(self.ints[l - 1][ii, kk])
        out = (np.concatenate(rows), np.concatenate(cols), np.concatenate(data))
        if full:
            self._shared_full = out
        else:
            self._shared = out
        return out

    def _column(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Input j's whole column in layers 2..L'−1 where the subgraph lacks it: flow to one input converges
        on that token's own nodes through many small edges that no per-row cut-off keeps. Each layer's
        missing edges are grouped by column once per subgraph version (int32 rows), and sliced here."""
        m = self.m
        if self._cols is None:
            self._cols = []
            for l in range(2, self.L):
                jj, ii = np.nonzero(((self.ints[l - 1] > 0) & ~self.sub[l - 1]).T)  # grouped by column
                self._cols.append((ii.astype(np.int32), np.searchsorted(jj, np.arange(m + 1))))
        rows, cols, data = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for l, (ii, bounds) in enumerate(self._cols, start=2):
            i = ii[bounds[j] : bounds[j + 1]]
            rows.append((l - 1) * m + i.astype(np.int64))
            cols.append(np.full(len(i), (l - 2) * m + j, np.int64))
            data.append(self.ints[l - 1][i, j])
        return np.concatenate(rows), np.concatenate(cols), np.concatenate(data)

    def _solve_batch(self, sinks: Sequence[int], full: bool) -> tuple[np.ndarray, Any, Any, int]:
        """Max flows to several inputs in one solver call: one disjoint copy of the (sub)graph per input,
        all fed by one super-source σ through the source's edges and drained into one super-sink τ through
        each copy's edges into its input. Components share no node but σ and τ, so the union's maximum flow
        is the sum of the copies' and restricted to a copy it is that copy's maximum flow (exact).

        Returns (int flow per input, union graph, scipy result, nodes per copy V); copy k's node (l, i),
        l = 1..L'−1, has id k·V + (l−1)·m + i; σ = K·V, τ = K·V + 1."""
        from scipy.sparse import csr_array
        from scipy.sparse.csgraph import maximum_flow

        m, L, K = self.m, self.L, len(sinks)
        V = (L - 1) * m
        sigma, tau = K * V, K * V + 1
        r0, c0, d0 = self._internal(full)
        top = self.ints[L - 1][self.source]  # the source's edges, into layer L'−1
        tk = np.flatnonzero(top > 0)
        offs = np.arange(K, dtype=np.int64) * V
        rows = [(r0[None, :] + offs[:, None]).ravel(), np.full(K * len(tk), sigma)]
        cols = [(c0[None, :] + offs[:, None]).ravel(), ((L - 2) * m + tk[None, :] + offs[:, None]).ravel()]
        data = [np.tile(d0, K), np.tile(top[tk], K)]
        b = self.ints[0][:, list(sinks)]  # (m, K): the edges into each copy's input
        bi, bk = np.nonzero(b.T > 0)[::-1]
        rows.append(bi + offs[bk])
        cols.append(np.full(len(bi), tau))
        data.append(b[bi, bk])
        if not full:
            for k, j in enumerate(sinks):
                r, c, d = self._column(j)
                rows.append(r + offs[k])
                cols.append(c + offs[k])
                data.append(d)
        g = csr_array(
            (np.concatenate(data).astype(np.int32), (np.concatenate(rows), np.concatenate(cols))),
            shape=(K * V + 2, K * V + 2),
        )
        res = maximum_flow(g, sigma, tau)
        self.stats["calls"] += 1
        self.stats["full" if full else "sub"] += K
        f = res.flow
        lo, hi = f.indptr[sigma], f.indptr[sigma + 1]
        out = f.data[lo:hi].astype(np.int64)
        per = np.zeros(K, np.int64)
        np.add.at(per, f.indices[lo:hi] // V, np.maximum(out, 0))
        return per, g, res, V

    def _source_sides(self, g: Any, res: Any, V: int, copies: Sequence[int]) -> list[list[np.ndarray]]:
        """For each copy: the nodes reachable from σ in the residual graph (the source side of a minimum
        cut of that copy), split by layer: index l−1 holds layer l (layer L' is the source alone)."""
        from scipy.sparse.csgraph import breadth_first_order

        self.stats["cuts"] += len(copies)
        resid = g - res.flow  # cap − flow; reverse edges get +flow
        resid.data = (resid.data > 0).astype(np.int8)
        resid.eliminate_zeros()
        sigma = g.shape[0] - 2
        order = breadth_first_order(resid, sigma, directed=True, return_predecessors=False)
        side = np.zeros(g.shape[0], bool)
        side[order] = True
        m, out = self.m, []
        for k in copies:
            local = side[k * V : (k + 1) * V]
            out.append([local[(l - 1) * m : l * m] & self.keep[l] for l in range(1, self.L)] + [self._only_source()])
        return out

    def _missing(self, R: list[np.ndarray], j: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Edges of positive integer capacity that leave the node set R (R[l-1] = its layer-l part) and that
        input j's subgraph lacks, as (layer, rows, columns)."""
        found = []
        for l in range(2, self.L):  # the source's edges (layer L') and the edges into j are always there
            ri = np.flatnonzero(R[l - 1])
            ci = np.flatnonzero(~R[l - 2] & self.keep[l - 1] & (np.arange(self.m) != j))
            if len(ri) == 0 or len(ci) == 0:
                continue
            block = (self.ints[l - 1][np.ix_(ri, ci)] > 0) & ~self.sub[l - 1][np.ix_(ri, ci)]
            if block.any():
                a, b = np.nonzero(block)
                found.append((l, ri[a], ci[b]))
        return found

    def _add_edges(self, edges: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        for l, a, b in edges:
            self.sub[l - 1][a, b] = True
            self.stats["added"] += len(a)
        if edges:
            self._shared = None
            self._cols = None

    def _flow_edges(self, res: Any, V: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copy k's positive edge flows as (tail ids, head ids, int flow) in single-graph ids: node (l, i)
        is (l−1)·m + i for l = 1..L', the source (L', source) and the super-sink T = L'·m."""
        from scipy.sparse import coo_array

        f = coo_array(res.flow)
        sigma, tau = f.shape[0] - 2, f.shape[0] - 1
        on = f.data > 0
        u, v, x = f.row[on], f.col[on], f.data[on].astype(np.int64)
        mine = ((u >= k * V) & (u < (k + 1) * V)) | ((u == sigma) & (v >= k * V) & (v < (k + 1) * V))
        u, v, x = u[mine], v[mine], x[mine]
        src, T = (self.L - 1) * self.m + self.source, self.L * self.m
        u = np.where(u == sigma, src, u - k * V)
        v = np.where(v == tau, T, v - k * V)
        return u, v, x

    def _add_support(self, res: Any, V: int) -> None:
        """Add the internal edges that carry flow in a whole-graph solution to the subgraph: flows to
        different inputs share most of their routes through the upper layers."""
        u, v, _ = self._flow_edges(res, V, 0)
        T = self.L * self.m
        inner = (u >= self.m) & (v < T) & (u < (self.L - 1) * self.m)
        u, v = u[inner], v[inner]
        layer = u // self.m + 1
        self._add_edges([(int(l), u[layer == l] % self.m, v[layer == l] % self.m) for l in np.unique(layer)])

    def _add_cut(self, R: list[np.ndarray]) -> None:
        """Pool the cut with source side R (R[l-1] = its layer-l part) into every input's upper bound.

        Its layers 2..L' are kept; its layer-1 part is re-chosen per input j, optimally: a layer-1 node
        either stays on the source side and pays its edge into j, or joins the sink side and pays the
        edges entering it from R's layer 2, whichever is cheaper. (With R = everything this is the
        two-layer cut; with two layers it is the exact answer Σ_i min(Ã_2[s, i], Ã_1[i, j]).)"""
        c_int, c_real = 0, 0.0
        for l in range(3, self.L + 1):
            ri = np.flatnonzero(R[l - 1])
            ci = np.flatnonzero(~R[l - 2])
            if len(ri) and len(ci):
                c_int += int(self.ints[l - 1][np.ix_(ri, ci)].sum())
                c_real += float(self.real[l - 1][np.ix_(ri, ci)].sum())
        r2 = R[1]
        into_int = self.ints[1][r2].sum(axis=0)  # capacity from R's layer 2 into each layer-1 node
        into_real = self.real[1][r2].sum(axis=0)
        self.ub_int = np.minimum(self.ub_int, c_int + np.minimum(self.ints[0], into_int[:, None]).sum(axis=0))
        self.ub_real = np.minimum(self.ub_real, c_real + np.minimum(self.real[0], into_real[:, None]).sum(axis=0))

    # sinks ----------------------------------------------------------------------------------------------
    def solve(self, sinks: Sequence[int], tick: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(values, gaps) for the given input indices: values are the certified upper bounds U, gaps the
        certified U − lower bound (see the module docstring)."""
        sinks = [int(j) for j in sinks]
        values = np.zeros(len(sinks))
        gaps = np.zeros(len(sinks))
        if self.L == 1:
            # One layer: the source's edge to the input is the only path, so the flow is that capacity.
            values[:] = self.real[0][self.source, sinks]
            if tick:
                tick(len(sinks))
            return values, gaps
        where = {j: t for t, j in enumerate(sinks)}
        rounds = dict.fromkeys(sinks, 0)
        pending = []
        for j in sinks:
            if self.empty or self.ub_real[j] <= 0.0:  # a cut of capacity 0: no flow at all
                if tick:
                    tick(1)
            else:
                pending.append(j)

        def finish(j: int, flow: int, res: Any, V: int, k: int) -> None:
            low, up = flow / self.scale, float(self.ub_real[j])
            if up - low > GAP_TOL:
                low, up = self._refine(j, self._flow_edges(res, V, k), low, up)
                if up - low > GAP_TOL:  # not seen in practice: would need a cut of ~millions of edges
                    warnings.warn(
                        f"attention_flow: input {j}'s value is certified only to within {up - low:.2e} "
                        f"(target {GAP_TOL:.0e})",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            values[where[j]] = up  # the tightest certified upper bound; the exact flow lies in [low, up]
            gaps[where[j]] = max(up - low, 0.0)
            if tick:
                tick(1)

        width = 1  # inputs per call: doubles while every input is certified at once, halves otherwise,
        # so hard graphs learn cuts and edges input by input and easy ones amortise the call cost
        while pending:
            per_copy = max(len(self._internal(False)[0]) + self.L * self.m, 1)
            K = int(min(len(pending), width, max(1, self.batch_edges // per_copy)))
            batch, pending = pending[:K], pending[K:]
            flows, g, res, V = self._solve_batch(batch, full=False)
            open_ = [k for k, j in enumerate(batch) if flows[k] != self.ub_int[j]]
            width = max(1, width // 2) if open_ else 2 * K
            for k, j in enumerate(batch):
                if flows[k] == self.ub_int[j]:  # the subgraph's flow meets a known cut: certified
                    finish(j, int(flows[k]), res, V, k)
            if not open_:
                continue
            sides = self._source_sides(g, res, V, open_)
            retry = []
            for k, R in zip(open_, sides):
                j = batch[k]
                missing = self._missing(R, j)
                if not missing:  # R's capacity in the whole graph equals the flow: a minimum cut
                    self._add_cut(R)
                    finish(j, int(flows[k]), res, V, k)
                elif rounds[j] < _MAX_ROUNDS and sum(len(a) for _, a, _ in missing) <= _GROW_LIMIT * self.m:
                    self._add_edges(missing)  # grow the subgraph across this cut and try again
                    rounds[j] += 1
                    retry.append(j)
                else:
                    # Too far from the whole graph's cut: solve the whole graph for this input once and
                    # learn from it (its cut bounds every input; its flow's edges join the subgraph).
                    fl, gf, rf, Vf = self._solve_batch([j], full=True)
                    self._add_cut(self._source_sides(gf, rf, Vf, [0])[0])
                    self._add_support(rf, Vf)
                    finish(j, int(fl[0]), rf, Vf, 0)
            pending = retry + pending
        return values, gaps

    def _refine(
        self, j: int, flow_edges: tuple[np.ndarray, np.ndarray, np.ndarray], low: float, up: float
    ) -> tuple[float, float]:
        """Tighten [low, up] for input j: solve the residual of the integer flow (real capacities minus the
        flow found, over the whole graph) at a finer scale. Its max flow is F − low ≤ gap; capacities are
        clipped at the gap (a max flow of that value never needs more on one edge), so the scale can grow
        to 2³⁰/gap."""
        from scipy.sparse import csr_array
        from scipy.sparse.csgraph import breadth_first_order, maximum_flow

        L, m, S = self.L, self.m, self.scale
        gap = up - low
        fr, fc, fv = flow_edges
        n = L * m + 1
        T = L * m
        rows, cols, vals = [], [], []
        for l in range(2, L + 1):
            ii, kk = np.nonzero(self.real[l - 1] > 0)
            rows.append((l - 1) * m + ii)
            cols.append((l - 2) * m + kk)
            vals.append(self.real[l - 1][ii, kk])
        b = self.real[0][:, j]
        ones = np.flatnonzero(b > 0)
        rows.append(ones)
        cols.append(np.full(len(ones), T))
        vals.append(b[ones])
        cap = csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n))
        used = csr_array((fv.astype(np.float64) / S, (fr, fc)), shape=(n, n))
        forward = (cap - used).tocoo()
        back = used.T.tocoo()
        rr = np.concatenate([forward.row, back.row])
        cc = np.concatenate([forward.col, back.col])
        vv = np.minimum(np.concatenate([forward.data, back.data]), gap)
        S2 = 2.0 ** math.floor(math.log2(2**30 / gap))
        iv = np.floor(np.maximum(vv, 0.0) * S2).astype(np.int64)
        keep = iv > 0
        g = csr_array((iv[keep].astype(np.int32), (rr[keep], cc[keep])), shape=(n, n))
        g.sum_duplicates()
        src = (L - 1) * m + self.source
        res = maximum_flow(g, src, T)
        # Certify the refined value by the refined residual's own minimum cut R2: its clipped real capacity
        # bounds F − low from above, exactly as the integer flow bounds it from below.
        resid = g - res.flow
        resid.data = (resid.data > 0).astype(np.int8)
        resid.eliminate_zeros()
        side = np.zeros(n, bool)
        side[breadth_first_order(resid, src, directed=True, return_predecessors=False)] = True
        across = side[rr] & ~side[cc] & (vv > 0)
        low2 = low + int(res.flow_value) / S2
        return low2, min(up, low + float(vv[across].sum()))


#: Per-example capacities handed to forked worker processes by inheritance instead of pickling; the lock
#: keeps two threads that both run attention_flow(n_jobs > 1) from handing each other's data.
_FORKED: list[np.ndarray] = []
_FORK_LOCK = threading.Lock()


def _solve_task(caps: np.ndarray | int, source: int, sinks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """One (example, output, block of inputs) task; top level so that worker processes can run it.
    ``caps`` is the (L', m, m) stack, or an index into ``_FORKED`` in a forked worker."""
    if isinstance(caps, int):
        caps = _FORKED[caps]
    return _RowSolver(caps, source).solve(sinks)


# ------------------------------------------------------------------------------------------- memory
def estimate_memory(num_layers: int, n: int, workers: int = 1, *, batch: int = 0) -> int:
    """Peak bytes ``attention_flow`` may need for one graph of ``num_layers`` layers of n tokens, times the
    number of graphs solved at once (``workers``): about 62 bytes per potential edge (L'·n²); plus, with
    ``batch``, the dense capacities of every example built before any graph (the augmented layers and
    their float64 stack: 16 bytes per entry of B·L'·n²)."""
    return int(workers * num_layers * n * n * _BYTES_PER_EDGE + batch * num_layers * n * n * _BYTES_DENSE)


def _check_memory(num_layers: int, n: int, workers: int, have: int | None, batch: int = 0) -> None:
    """MemoryError when the estimate exceeds ``have`` bytes (no check when ``have`` is None)."""
    need = estimate_memory(num_layers, n, workers, batch=batch)
    if have is not None and need > have:
        gib = 2**30
        raise MemoryError(
            f"attention_flow: the flow graph would not fit in memory: {num_layers} layers x {n} tokens "
            f"({num_layers * n + 1} nodes, up to {num_layers * n * n:,} edges) needs about {need / gib:.2f} GiB "
            f"with n_jobs={workers}, but only about {have / gib:.2f} GiB is available. Use fewer layers "
            "(start_layer/end_layer), fewer workers (n_jobs), crop padding (attention_mask), or sparsify "
            "(top_k, threshold, discard_ratio)."
        )


# ------------------------------------------------------------------------------------------- public API
def _check_jobs(n_jobs: Any) -> int:
    if n_jobs is None:
        return 1
    n_jobs = _checks.check_int("n_jobs", n_jobs)
    if n_jobs == -1:
        return max(os.cpu_count() or 1, 1)
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be a positive number of worker processes or -1 for all cores, got {n_jobs}")
    return n_jobs


@contextlib.contextmanager
def _one_torch_thread():
    """Build the capacities with one torch thread: the work is a few elementwise passes, far cheaper
    than the flows, and OpenMP workers spinning for it cost more than they save when cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _unit_exponent(caps: np.ndarray) -> int:
    """e with max(caps)·2^-e in (0.5, 1] (0 for an all-zero graph, and when the largest capacity is in
    (0.5, 1], as with the default residual). Max flow is linear in the capacities, so the solver works on
    caps·2^-e — exact in binary floating point, for capacities of any magnitude, subnormal (1e-310) or
    near the float64 limit — and its values are scaled back by 2^e."""
    top = float(caps.max()) if caps.size else 0.0
    if not top > 0:
        return 0
    mant, e = np.frexp(top)
    return int(e) - 1 if mant == 0.5 else int(e)


def _check_progress(progress: Any) -> Callable[[int, int], Any] | None:
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be None or a callable progress(done, total), got {_checks.describe(progress)}")
    return progress


def _plan(stack: np.ndarray, mask: np.ndarray | None, row_idx: list[int], workers: int, n_layers: int):
    """Per example (kept token indices, capacities cropped to them and scaled by 2^-e, e); the (example,
    output row, source index, block of inputs) tasks; the number of workers worth starting."""
    batch, n = stack.shape[0], stack.shape[-1]
    per_example = []
    for b in range(batch):
        keep = np.arange(n) if mask is None else np.flatnonzero(mask[b])
        caps = np.ascontiguousarray(stack[b][:, keep][:, :, keep]) if mask is not None else stack[b]
        e = _unit_exponent(caps)
        per_example.append((keep, np.ldexp(caps, -e), e))
    # One task per (example, output, block of inputs); padded outputs are simply left at 0.
    problems = [
        (b, q, int(np.searchsorted(per_example[b][0], r)))
        for b in range(batch)
        for q, r in enumerate(row_idx)
        if len(per_example[b][0]) and (mask is None or mask[b, r])
    ]
    work = sum(len(per_example[b][0]) ** 3 * n_layers for b, _, _ in problems)  # ~ edges x inputs
    if work < _PARALLEL_WORK:
        workers = 1  # well under a second of work: starting processes would cost more than it saves
    tasks = []
    for b, q, src in problems:
        m = len(per_example[b][0])
        blocks = workers if (workers > 1 and len(problems) < workers) else 1
        for chunk in np.array_split(np.arange(m), min(blocks, m)):
            tasks.append((b, q, src, chunk))
    return per_example, tasks, workers


def _solve_in_workers(
    per_example: list, tasks: list, workers: int, out: np.ndarray, tick: Callable[[int], Any]
) -> None:
    """Run the tasks in worker processes (fork when available: workers inherit the capacities)."""
    import multiprocessing as mp

    fork = "fork" in mp.get_all_start_methods()
    ctx = mp.get_context("fork" if fork else None)
    lock = _FORK_LOCK if fork else contextlib.nullcontext()
    with lock:
        if fork:  # workers inherit the capacities; only indices travel through the pipes
            _FORKED[:] = [caps for _, caps, _ in per_example]
        try:
            with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx) as pool:
                futures = [
                    pool.submit(_solve_task, b if fork else per_example[b][1], src, chunk.tolist())
                    for b, q, src, chunk in tasks
                ]
                for fut, (b, q, src, chunk) in zip(futures, tasks):
                    values, _ = fut.result()
                    out[b, q, per_example[b][0][chunk]] = np.ldexp(values, per_example[b][2])
                    tick(len(chunk))
        finally:
            _FORKED.clear()


def _solve(per_example: list, tasks: list, workers: int, shape: tuple[int, int, int],
           progress: Callable[[int, int], Any] | None) -> np.ndarray:
    """The raw max-flow values (B, rows, n) of every task, in this process or in workers."""
    total = sum(len(t[3]) for t in tasks)
    tick = (lambda k: progress(k, total)) if progress is not None else (lambda k: None)  # noqa: E731
    tick(0)
    out = np.zeros(shape)
    if workers == 1 or len(tasks) <= 1:
        for b, q, src, chunk in tasks:
            keep, caps, e = per_example[b]
            values, _ = _RowSolver(caps, src).solve(chunk.tolist(), tick=tick)
            out[b, q, keep[chunk]] = np.ldexp(values, e)
    else:
        _solve_in_workers(per_example, tasks, workers, out, tick)
    return out


def _rows_within_memory(attentions: Any, fused: bool, mask: Any, start_layer: Any, end_layer: Any, rows: Any,
                        workers: int, available_memory: int | None) -> list[int] | None:
    """The output rows, after checking from the shapes alone (before any dense capacity is built) that the
    graphs fit in ``available_memory``."""
    shape = parse_attentions(attentions, fused=fused, attention_mask=mask, validate=False)
    first, last = layer_range(len(shape.tensors), start_layer, end_layer)
    row_idx = parse_rows(rows, shape.n)
    _check_memory(last - first, shape.n, workers, available_memory, shape.batch)
    return row_idx


def attention_flow(
    attentions: Any,
    *,
    head_fusion: Any = "mean",
    alpha: float = 0.5,
    residual_mode: str = "blend",
    discard_ratio: float = 0.0,
    discard_scope: str = "layer",
    top_k: int | None = None,
    threshold: float | None = None,
    protect_prefix: int = 1,
    rows: Any = (0,),
    start_layer: int = 0,
    end_layer: int | None = None,
    normalize: bool = True,
    attention_mask: Any = None,
    check_stochastic: bool = True,
    dtype: Any = None,
    n_jobs: int = 1,
    progress: Callable[[int, int], Any] | None = None,
    available_memory: int | None = None,
) -> Any:
    """Attention flow: the max-flow value from each chosen output token to each input token.

    The capacity graph is layered: node (l, i) for l = 0..L' (L' = end_layer − start_layer; layer 0 holds
    the inputs) and an edge (l, i) → (l−1, k) of capacity Ã_l[i, k], the augmented attention of layer
    start_layer + l − 1 built exactly as ``rollout`` builds it (head fusion, padding, sparsification, row
    rescaling, residual). For output row r the source is (L', r); each input (0, j) in turn is the sink.
    Flows are in the units of the capacities (attention mass; at most the source's row sum, 1 for the
    default residual). See the module docstring for the algorithm and its error bound: every raw value is
    within 5e-7 of the exact max flow (typically ~1e-9, often exact to float rounding).

    This is the pure function: it prints nothing and reads nothing from the machine. ``attnroll.attention_flow``
    wraps it with a progress bar (``progress=True``) and the machine's available memory.

    Args:
        attentions, head_fusion, alpha, residual_mode, discard_ratio, discard_scope, top_k, threshold,
            protect_prefix, start_layer, end_layer, attention_mask, check_stochastic, dtype: as in
            ``rollout`` (same meaning, defaults and validation).
        rows: output token index or indices (the sources); None means every token (n max-flow problems of n
            sinks each: costly).
        normalize: divide each output's row by its sum, as the reference code does (rows with zero sum stay
            0); False returns the raw max-flow values.
        n_jobs: worker processes (−1: all cores). Work is split over (example, output, block of inputs);
            problems under ~0.25 s of work run in this process, as starting workers costs ~0.1 s.
        progress: None, or ``progress(k, total)`` called with k = 0 before solving and with the number of
            max-flow problems just solved (of ``total``) as they finish.
        available_memory: bytes the graph may use; None = no memory check.

    Returns:
        (B, len(rows), n) — (len(rows), n) for unbatched input — of the input's kind (torch / numpy) in the
        working dtype. Padded tokens (``attention_mask`` 0) get 0, as inputs and as outputs, and do not
        change the other values: a padded batch gives what the cropped sequences give.

    Raises:
        MemoryError: when the graph would need more than ``available_memory`` (the message gives the estimate).
    """
    normalize = _checks.check_bool("normalize", normalize)
    progress = _check_progress(progress)
    workers = _check_jobs(n_jobs)
    row_idx = _rows_within_memory(attentions, head_fusion is None, attention_mask, start_layer, end_layer, rows,
                                  workers, available_memory)
    with _one_torch_thread():
        mats, layers, _ = augmented_layers(
            attentions, head_fusion=head_fusion, alpha=alpha, residual_mode=residual_mode,
            discard_ratio=discard_ratio, discard_scope=discard_scope, top_k=top_k, threshold=threshold,
            protect_prefix=protect_prefix, start_layer=start_layer, end_layer=end_layer,
            attention_mask=attention_mask, check_stochastic=check_stochastic, dtype=dtype,
        )
    n, batch, out_dtype = layers.n, layers.batch, mats[0].dtype
    row_idx = list(range(n)) if row_idx is None else row_idx
    stack = np.stack([t.detach().cpu().numpy() for t in mats], axis=1).astype(np.float64)  # (B, L', n, n)
    mask = None if layers.mask is None else layers.mask.cpu().numpy()
    per_example, tasks, workers = _plan(stack, mask, row_idx, workers, len(mats))
    out = _solve(per_example, tasks, workers, (batch, len(row_idx), n), progress)
    if normalize:
        total_flow = out.sum(axis=-1, keepdims=True)
        out = np.divide(out, total_flow, out=np.zeros_like(out), where=total_flow > 0)
    result = torch.from_numpy(out).to(device=mats[0].device, dtype=out_dtype)  # back where the input was
    return layers.give_back(result)
