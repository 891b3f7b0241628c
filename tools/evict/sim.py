"""A reference simulator of lfserve's KV slot pools (docs/DESIGN.md §3), in NumPy.

Several runs ("specs": a policy, a budget B and its parameters) go through the same token
sequence teacher-forced, side by side: every decode step is one batched forward over the runs,
each attending over its own pool. The step is attention/attention.c's, decision for decision:

decode step of one (layer, eviction scope):
  1. write: w = n < B ? n++ : next (the full policy at n == B: ContextFull, nothing written);
     ||v||_1 is cached (float32) with the slot;
  2. attend: alpha_h,i = softmax_i(q_h . k_i / sqrt(D)) over the n filled slots, o_h = sum alpha v;
  3. score: longflow s_i = ||v_i||_1 * sum_{h in group} alpha_h,i; h2o: the float32 mass
     accumulated since the slot was written (acc[w] = 0, then acc += mass, in float32);
     streaming: the slot's position; random: a seeded uniform draw; oracle: minus the next step
     at which the full-KV run attends to the slot's token strongly (see StrongUses). Four
     diagnostics take LongFlow's score apart (not served by lfserve): attn, the attention mass
     alone (sum_{h in group} alpha_h,i); vnorm, ||v_i||_1 alone; centered,
     sum_{h in group} alpha_h,i ||v_i - o_h||_1, what removing slot i changes o_h (to first
     order, the renormalisation included); ema, LongFlow's score remembered across steps:
     acc = gamma * acc + ||v_i||_1 sum_h alpha_h,i (the written slot starts from its own; slots
     written at prefill from 0), gamma 0 is LongFlow;
  4. choose: next = argmin over filled slots of the score summed over the scope's KV heads,
     excluding slots < sink, the slot w just written and (h2o, or a spec's recent=R) the most
     recent slots by (position, slot); lowest index on ties; -1 when nothing is left. Every head of the
     scope gets that next.

Scopes: "head" (one decision per (layer, KV head): lfserve's default), "layer" (one per layer,
the released LongFlow code: --evict-scope layer), "rank:T" (one per layer among the KV heads
one of T tensor-parallel ranks owns: DESIGN §4's split of the KV heads; with T >= Hkv a rank
holds one head, i.e. head scope).

prefill of a chunk of n_tok tokens into a pool holding n0 (lf_prefill_kind_of):
  - full policy, or n0 + n_tok <= B - 1: appended; exact causal attention over the pool's slots
    and the chunk; h2o slots get the chunk's column sums (existing ones add them);
  - n0 == 0 and n_tok > B - 1: SnapKV. W = lf_snapkv_window (min(window, B-1-sink); streaming:
    B-1-sink); L = n_tok - W; score of position j < L: the softmax weight the last W queries
    give it, summed over the group's heads, the W queries and the scope's KV heads; width-5
    zero-padded average pool over [0, L), always / 5; keep positions < sink, >= L and the
    B-1-sink-W best of [sink, L) (ties to the lower position), in position order in slots
    0..B-2;
  - otherwise: the chunk runs token by token as decode steps, layer by layer (as the C code).
  After prefill next = -1 and n <= B - 1.

Precision: the model and the attention run in the Model's dtype (float64 for the lockstep
check against lfserve, float32 for long runs); scores are formed in float64 from the stored
values (vnorm and h2o's acc are float32, as in the C pool).

Metrics hooks: with StrongUses tables the simulator keeps, for every slot, the next step at
which the full run needs its token (the oracle's key, and the harmful-eviction count: an
overwritten slot whose token the full run attends to strongly within the next `harm_window`
steps).
"""
import math

import numpy as np

POLICIES = ("full", "longflow", "streaming", "h2o", "random", "oracle", "attn", "vnorm", "centered",
            "ema", "rkv")
NEVER = np.int64(1) << 40  # "no further use"


class ContextFull(Exception):
    pass


class Spec:
    """One run: policy, budget and parameters (lfserve's defaults: sink 4, window 32, and h2o's
    recent window B/2, as lf_h2o_recent resolves lf_engine_config.h2o_recent = 0)."""

    def __init__(self, policy, budget, sink=4, window=32, h2o_recent=None, scope="head", seed=0,
                 tau=None, name=None, gamma=0.0, recent=None, stage=32, obs=8, lam=0.1,
                 sim_thr=0.5, pool_kernel=7, hist=False, layer_budgets=None, obs_half=False):
        if policy not in POLICIES:
            raise ValueError("policy %s (one of %s)" % (policy, ", ".join(POLICIES)))
        self.policy = policy
        self.budget = int(min(layer_budgets)) if layer_budgets else int(budget)
        self.sink = int(sink)
        self.window = int(window)
        self.h2o_recent = int(self.budget // 2 if h2o_recent is None else h2o_recent)
        if layer_budgets and policy not in ("h2o", "rkv"):
            raise ValueError("layer_budgets: h2o and rkv only")
        self.scope = scope
        self.seed = seed
        self.tau = tau  # oracle: which StrongUses table (None: the first)
        self.gamma = float(gamma)  # ema: the decay per step
        # the most recent slots (by position) never evicted: h2o's window; for the other scores
        # a diagnostic (recent=R), 0 = none
        self.recent = self.h2o_recent if policy == "h2o" else int(recent or 0)
        # rkv (attention.h): a selection every `stage` steps picks the next `stage` slots to
        # overwrite; importance = the attention of the last `obs` queries (max-pooled over
        # `pool_kernel` neighbours in position order), redundancy = the softmax of each key's mean
        # cosine similarity to the others (its most recent look-alike above sim_thr left out),
        # score = lam * importance - (1 - lam) * redundancy; the `obs` newest are kept
        self.stage, self.obs, self.lam = int(stage), int(obs), float(lam)
        # rkv: the window is each layer's budget / 2 (obs is then the smallest layer's), lowered
        # where a layer's budget leaves no room beside the sinks and a stage, as
        # lf_rkv_obs_resolve does
        self.obs_half = bool(obs_half)
        self.sim_thr, self.pool_kernel = float(sim_thr), int(pool_kernel)
        # rkv, a diagnostic (not served): importance = H2O's mass accumulated over the whole
        # history (never reset), normalized to sum 1 over the candidates as redundancy does
        self.hist = bool(hist)
        # a diagnostic (not served): per-layer budgets (a list over layers) in place of one
        # budget, their sum the layers times `budget`; h2o's window is each layer's B_l / 2, and
        # `budget` below becomes the smallest (what a prompt chunk may fill), `nominal` the mean
        self.layer_budgets = [int(b) for b in layer_budgets] if layer_budgets else None
        self.nominal = int(budget)
        if self.obs_half:
            self.obs = self.obs_at(self.budget)
        self.name = name or "%s/%s/B%d" % (policy, scope, budget)
        if policy != "full" and self.budget < self.sink + 2:
            raise ValueError("%s: budget %d < sink %d + 2" % (self.name, self.budget, self.sink))
        if policy == "rkv" and self.budget < self.sink + self.obs + self.stage + 1:
            raise ValueError("%s: budget %d < sink + obs + stage + 1" % (self.name, self.budget))
        if policy == "h2o" and self.budget < self.sink + self.h2o_recent + 2:
            raise ValueError("%s: budget %d < sink + h2o_recent + 2" % (self.name, self.budget))

    def obs_at(self, B):
        """rkv's observation window in a pool of B slots."""
        if not self.obs_half:
            return self.obs
        return max(1, min(B // 2, B - self.sink - self.stage - 1))

    def group_size(self, n_kv):
        s = self.scope
        if s == "head":
            return 1
        if s == "layer":
            return n_kv
        if s.startswith("rank:"):
            T = int(s[5:])
            if T >= n_kv:
                if T % n_kv:
                    raise ValueError("%s: %d ranks do not split %d KV heads" % (self.name, T, n_kv))
                return 1
            if n_kv % T:
                raise ValueError("%s: %d ranks do not split %d KV heads" % (self.name, T, n_kv))
            return n_kv // T
        raise ValueError("scope %s (head, layer, rank:T)" % s)

    def snapkv_window(self):
        fill = self.budget - 1 - self.sink
        w = fill if (self.policy == "streaming" or self.window > fill) else self.window
        return max(w, 0)

    def evicts(self):
        return self.policy != "full"


class StrongUses:
    """Per layer, CSR tables of the steps at which the full run attends strongly to each (KV
    head, key position): steps int32 [E], offsets int64 [Hkv][T+1] (model.full_pass)."""

    def __init__(self, tables, tau):
        self.tau = tau
        self.steps = [np.append(s.astype(np.int64), NEVER) for s, _ in tables]  # sentinel at end
        self.offsets = [o for _, o in tables]
        self.T = self.offsets[0].shape[1] - 1

    def first_after(self, l, g, keys, t):
        """Index (into steps[l]) of the first use of each key (head g) at a step > t, and the end
        of its segment."""
        st, off = self.steps[l], self.offsets[l][g]
        keys = np.asarray(keys)
        lo, hi = off[keys], off[keys + 1]
        idx = np.array([lo_ + np.searchsorted(st[lo_:hi_], t, side="right")
                        for lo_, hi_ in zip(lo, hi)], dtype=np.int64)
        return idx, hi


class Sim:
    def __init__(self, model, specs, uses=(), harm_window=200, record=False):
        self.m = model
        c = model.cfg
        self.specs = list(specs)
        R = self.R = len(self.specs)
        self.L, self.H, self.D, self.G = c.n_layers, c.n_kv_heads, c.head_dim, c.group
        self.C = max(max(s.layer_budgets or [s.budget]) for s in self.specs)
        dt = model.dtype
        L, H, C, D = self.L, self.H, self.C, self.D
        self.K = np.zeros((L, R, H, C, D), dt)
        self.V = np.zeros((L, R, H, C, D), dt)
        self.pos = np.full((L, R, H, C), -1, np.int64)
        self.vnorm = np.zeros((L, R, H, C), np.float32)
        self.acc = np.zeros((L, R, H, C), np.float32)
        self.n = np.zeros((L, R), np.int64)
        self.next = np.full((L, R, H), -1, np.int64)
        self.budget = np.array([s.budget for s in self.specs], np.int64)
        self.t = 0  # the position of the next token
        self.scale = dt(1.0 / math.sqrt(D))
        self.gsize = [s.group_size(H) for s in self.specs]
        self.rngs = [np.random.default_rng(s.seed) for s in self.specs]
        # runs grouped by (policy, group size) for the vectorised decision
        groups = {}
        for r, s in enumerate(self.specs):
            groups.setdefault((s.policy, self.gsize[r]), []).append(r)
        self.decide_groups = [(p, gs, np.array(rs)) for (p, gs), rs in groups.items()]
        self.want_centered = any(s.policy == "centered" for s in self.specs)
        self.sink = np.array([s.sink for s in self.specs], np.int64)
        # per layer: each run's budget and protected window (they differ by layer only under
        # layer_budgets)
        self.budget_l = np.array([[s.layer_budgets[l] if s.layer_budgets else s.budget
                                   for s in self.specs] for l in range(self.L)], np.int64)
        self.recent_l = np.array([[s.layer_budgets[l] // 2 if s.layer_budgets else s.recent
                                   for s in self.specs] for l in range(self.L)], np.int64)
        self.gamma = np.array([s.gamma for s in self.specs], np.float64)
        # strong-use tables: next-use pointers per table for every slot of every run
        self.uses = list(uses)
        self.ptr = [np.zeros((L, R, H, C), np.int64) for _ in self.uses]
        self.end = [np.zeros((L, R, H, C), np.int64) for _ in self.uses]
        self.oracle_table = []
        for s in self.specs:
            ti = 0
            if s.policy == "oracle":
                if not self.uses:
                    raise ValueError("the oracle needs StrongUses tables")
                taus = [u.tau for u in self.uses]
                ti = taus.index(s.tau) if s.tau is not None else 0
            self.oracle_table.append(ti)
        self.harm_window = harm_window
        self.evictions = np.zeros(R, np.int64)
        self.harmful = np.zeros(R, np.int64)      # needed again within harm_window steps
        self.needed_later = np.zeros(R, np.int64)  # needed again at all
        self.evict_log = [] if record else None    # (step, layer, run, head, slot, evicted pos)
        # rkv: steps since the last selection (-1: none yet), whether the observation window is
        # accumulating, and the slots chosen to be overwritten next, in order
        self.rk_since = np.full((L, R), -1, np.int64)
        self.rk_obs_on = np.zeros((L, R), dtype=bool)
        S = max([sp.stage for sp in self.specs if sp.policy == "rkv"] or [1])
        self.rk_queue = np.full((L, R, H, S), -1, np.int64)
        self.last_scores = [None] * L  # per layer: [R][H][C] the combined score the argmin saw

    # ------------------------------------------------------------------ the decode step

    def decode(self, token):
        """One decode step of every run with the same token; returns logits [R][vocab]."""
        m, R = self.m, self.R
        full_now = (self.n[0] == self.budget) & np.array([not s.evicts() for s in self.specs])
        if full_now.any():
            raise ContextFull("full policy: all slots filled at position %d (runs %s)"
                              % (self.t, list(np.nonzero(full_now)[0])))
        x = np.repeat(m.embed[token][None, :], R, axis=0)
        cs = m.rope_cs(self.t)
        for l in range(self.L):
            h = m.rmsnorm(x, m.layers[l]["rms_att"])
            q, k, v = m.qkv(l, h, cs=cs)
            att = self.decode_attn(l, q, k, v, self.t, np.arange(R))
            x = m.attn_out_mlp(l, x, att.reshape(R, -1))
        self.t += 1
        return m.logits(x)

    def decode_attn(self, l, q, k, v, t, runs):
        """Steps 1-4 at layer l for the runs `runs` (index array), token at position t:
        q [R'][Hq][D], k, v [R'][H][D]. Returns the attention output [R'][Hq][D]."""
        H, C, D, G = self.H, self.C, self.D, self.G
        Rr = len(runs)
        all_runs = Rr == self.R
        sel = slice(None) if all_runs else runs
        n0 = self.n[l, sel]
        B = self.budget_l[l, sel]
        was_full = n0 == B
        if np.any(was_full & np.array([not self.specs[r].evicts() for r in runs])):
            raise ContextFull("full policy: all slots filled at position %d" % t)
        nxt = self.next[l, sel]
        w = np.where(was_full[:, None], nxt, n0[:, None])  # [R'][H]
        if np.any(was_full[:, None] & ((nxt < self.sink[sel][:, None]) | (nxt >= B[:, None]))):
            raise RuntimeError("layer %d: a full pool without an evictable next" % l)
        ri = np.asarray(runs)[:, None]
        gi = np.arange(H)[None, :]

        # harmful-eviction accounting (table 0) and the log, before the overwrite
        if was_full.any():
            fr = np.nonzero(was_full)[0]
            self.evictions[np.asarray(runs)[fr]] += H
            if self.uses:
                p0, e0 = self.ptr[0][l, ri[fr], gi, w[fr]], self.end[0][l, ri[fr], gi, w[fr]]
                nu = np.where(p0 < e0, self.uses[0].steps[l][p0], NEVER)
                np.add.at(self.harmful, np.asarray(runs)[fr], (nu < t + self.harm_window).sum(1))
                np.add.at(self.needed_later, np.asarray(runs)[fr], (nu < NEVER).sum(1))
            if self.evict_log is not None:
                old = self.pos[l, ri[fr], gi, w[fr]]
                for a, r in enumerate(np.asarray(runs)[fr]):
                    for g in range(H):
                        self.evict_log.append((t, l, int(r), g, int(w[fr][a, g]), int(old[a, g])))

        # 1. write
        self.K[l, ri, gi, w] = k
        self.V[l, ri, gi, w] = v
        self.pos[l, ri, gi, w] = t
        self.vnorm[l, ri, gi, w] = np.abs(v.astype(np.float64)).sum(-1).astype(np.float32)
        for ti, u in enumerate(self.uses):
            st, off = u.steps[l], u.offsets[l]
            self.ptr[ti][l, ri, gi, w] = off[gi, t] if t < u.T else len(st) - 1
            self.end[ti][l, ri, gi, w] = off[gi, t + 1] if t < u.T else len(st) - 1
        n = np.where(was_full, B, n0 + 1)
        self.n[l, sel] = n

        # 2. attend
        Kl = self.K[l] if all_runs else self.K[l, runs]   # [R'][H][C][D]
        Vl = self.V[l] if all_runs else self.V[l, runs]
        qg = q.reshape(Rr, H, G, D)
        lg = np.matmul(qg, Kl.swapaxes(-1, -2)) * self.scale  # [R'][H][G][C]
        valid = np.arange(C)[None, :] < n[:, None]  # [R'][C]
        lg = np.where(valid[:, None, None, :], lg, -np.inf)
        mx = lg.max(-1, keepdims=True)
        e = np.exp(lg - mx)
        alpha = e / e.sum(-1, keepdims=True)
        out = np.matmul(alpha, Vl).reshape(Rr, H * G, D)
        mass = alpha.sum(2)  # [R'][H][C]
        centered = None
        if self.want_centered:  # [R'][H][C]: sum_h alpha_h,i ||v_i - o_h||_1
            og = out.reshape(Rr, H, G, 1, D).astype(np.float64)
            dv = np.abs(Vl[:, :, None, :, :].astype(np.float64) - og).sum(-1)  # [R'][H][G][C]
            centered = (alpha * dv).sum(2)

        # strong-use pointers move past step t
        for ti, u in enumerate(self.uses):
            P = self.ptr[ti][l] if all_runs else self.ptr[ti][l, runs]
            E = self.end[ti][l] if all_runs else self.end[ti][l, runs]
            adv = (P < E) & (u.steps[l][P] <= t) & valid[:, None, :]
            if all_runs:
                self.ptr[ti][l] += adv
            else:
                self.ptr[ti][l, runs] = P + adv

        # 3-4. scores and the choice, per (policy, scope) group of runs
        self._decide(l, runs, sel, all_runs, w, n, mass, t, centered)
        return out

    def _decide(self, l, runs, sel, all_runs, w, n, mass, t, centered=None):
        H, C = self.H, self.C
        runs = np.asarray(runs)
        pos_of = {r: i for i, r in enumerate(runs)}
        scores_all = np.full((len(runs), H, C), np.inf)
        for policy, gs, members in self.decide_groups:
            rs = [r for r in members if r in pos_of] if not all_runs else list(members)
            if not rs:
                continue
            li = np.array([pos_of[r] for r in rs])  # rows in this call's arrays
            ra = np.array(rs)
            if policy == "h2o":
                acc = self.acc[l, ra]
                acc[np.arange(len(ra))[:, None], np.arange(H)[None, :], w[li]] = 0.0
                acc += mass[li].astype(np.float32)
                self.acc[l, ra] = acc
            if policy == "rkv":
                self._rkv_step(l, ra, li, w, n, mass)
                continue
            if policy == "full":
                self.next[l, ra] = -1  # never evicts: no candidate, as in attention.c
                continue
            if policy in ("longflow",):
                s = self.vnorm[l, ra].astype(np.float64) * mass[li].astype(np.float64)
            elif policy == "ema":
                acc = self.acc[l, ra].astype(np.float64)
                acc[np.arange(len(ra))[:, None], np.arange(H)[None, :], w[li]] = 0.0
                acc = self.gamma[ra][:, None, None] * acc + \
                    self.vnorm[l, ra].astype(np.float64) * mass[li].astype(np.float64)
                self.acc[l, ra] = acc.astype(np.float32)
                s = acc
            elif policy == "centered":
                s = centered[li]
            elif policy == "attn":
                s = mass[li].astype(np.float64)
            elif policy == "vnorm":
                s = self.vnorm[l, ra].astype(np.float64)
            elif policy == "h2o":
                s = self.acc[l, ra].astype(np.float64)
            elif policy == "streaming":
                s = self.pos[l, ra].astype(np.float64)
            elif policy == "random":
                s = np.stack([self.rngs[r].random((H, C)) for r in ra])
            elif policy == "oracle":
                s = np.empty((len(ra), H, C))
                for a, r in enumerate(ra):
                    ti = self.oracle_table[r]
                    P, E = self.ptr[ti][l, r], self.end[ti][l, r]
                    nu = np.where(P < E, self.uses[ti].steps[l][P], NEVER)
                    s[a] = -nu.astype(np.float64)
            ng = H // gs
            if policy == "oracle":
                tot = s.reshape(len(ra), ng, gs, C).max(2)  # the earliest need in the scope
            else:
                tot = s.reshape(len(ra), ng, gs, C).sum(2)
            # exclusions (the scope's first head stands for its heads: they share w and pos)
            first = np.arange(ng) * gs
            slot = np.arange(C)[None, None, :]
            ex = np.zeros((len(ra), ng, C), dtype=bool)
            ex |= slot >= n[li][:, None, None]
            ex |= slot < self.sink[ra][:, None, None]
            ex |= slot == w[li][:, first][:, :, None]
            if np.any(self.recent_l[l, ra] > 0):
                p = self.pos[l, ra][:, first, :]  # [r][ng][C]
                key = np.where(slot < n[li][:, None, None], p * (np.int64(1) << 32) + slot,
                               np.iinfo(np.int64).min)
                srt = np.sort(key, axis=-1)
                rec = self.recent_l[l, ra]
                for a in range(len(ra)):
                    if rec[a] <= 0:
                        continue
                    if rec[a] >= n[li][a]:
                        ex[a] = True
                    else:
                        thr = srt[a, :, C - rec[a]]
                        ex[a] |= key[a] >= thr[:, None]
            tot = np.where(ex, np.inf, tot)
            best = np.argmin(tot, axis=-1)  # lowest index on ties
            best = np.where(np.isinf(np.take_along_axis(tot, best[..., None], -1)[..., 0]), -1, best)
            self.next[l, ra] = np.repeat(best, gs, axis=1)
            scores_all[li] = np.repeat(tot, gs, axis=1)
        self.last_scores[l] = scores_all

    def _rkv_step(self, l, ra, li, w, n, mass):
        """rkv at layer l after the write and the attention of step t, for runs `ra` (rows `li`):
        the observation window's accumulation, and every `stage` steps once the pool is full, the
        selection of the next `stage` slots to overwrite."""
        H, G = self.H, self.G
        for a, r in zip(li, ra):
            sp = self.specs[r]
            B, S = int(self.budget_l[l, r]), sp.stage
            obs = sp.obs_at(B)
            nr = int(n[a])
            if self.rk_since[l, r] < 0:
                k_left = B - nr  # the first selection when the pool fills
            else:
                self.rk_since[l, r] += 1
                k_left = S - self.rk_since[l, r]
            if sp.hist:
                self.acc[l, r, np.arange(H), w[a]] = 0.0
                self.acc[l, r] += mass[a].astype(np.float32)
            elif k_left < obs:
                if not self.rk_obs_on[l, r]:
                    self.acc[l, r] = 0.0
                    self.rk_obs_on[l, r] = True
                self.acc[l, r, np.arange(H), w[a]] = 0.0
                self.acc[l, r] += mass[a].astype(np.float32)
            if k_left <= 0:
                gs = self.gsize[r]
                for g0 in range(0, H, gs):  # one choice per scope: the heads' scores summed
                    q = self._rkv_select(l, r, range(g0, g0 + gs), sp, nr)
                    self.rk_queue[l, r, g0:g0 + gs, :S] = q[None, :]
                self.rk_since[l, r] = 0
                self.rk_obs_on[l, r] = False
            if self.rk_since[l, r] >= 0:
                self.next[l, r] = self.rk_queue[l, r, :, self.rk_since[l, r]]
            else:
                self.next[l, r] = -1

    def _rkv_select(self, l, r, heads, sp, nr):
        """The `stage` slots of (layer l, run r) to overwrite next for the KV heads `heads` (one
        scope: they hold the same positions in the same slots), lowest summed score first."""
        heads = list(heads)
        pos = self.pos[l, r, heads[0], :nr]
        order = np.argsort(pos, kind="stable")          # slots in position order
        obs = sp.obs_at(int(self.budget_l[l, r]))
        rest = order[:nr - obs]                          # all but the observation window (kept)
        score = sum(self._rkv_head_score(l, r, g, sp, rest, obs) for g in heads)
        cand = rest >= sp.sink
        idx = np.nonzero(cand)[0]
        if len(idx) < sp.stage:
            raise RuntimeError("%s: %d candidates for a stage of %d" % (sp.name, len(idx), sp.stage))
        pick = idx[np.lexsort((rest[idx], score[idx]))[:sp.stage]]  # ties: lower slot first
        return rest[pick]

    def _rkv_head_score(self, l, r, g, sp, rest, obs):
        """R-KV's score of the slots `rest` (in position order) of KV head g."""
        imp = self.acc[l, r, g, rest].astype(np.float64)
        imp = imp / max(imp.sum(), 1e-30) if sp.hist else imp / (self.G * obs)
        if sp.pool_kernel > 1:                           # max over neighbours in position order
            h = sp.pool_kernel // 2
            pad = np.concatenate([np.full(h, -np.inf), imp, np.full(h, -np.inf)])
            imp = np.max(np.stack([pad[i:i + len(rest)] for i in range(2 * h + 1)]), 0)
        k = self.K[l, r, g, rest].astype(np.float64)
        kn = k / (np.linalg.norm(k, axis=1, keepdims=True) + 1e-8)
        cos = kn @ kn.T
        np.fill_diagonal(cos, 0.0)
        similar = cos > sp.sim_thr
        has = similar.any(1)
        last = len(rest) - 1 - np.argmax(similar[:, ::-1], axis=1)  # the most recent look-alike
        cos[np.nonzero(has)[0], last[has]] = 0.0
        m = cos.mean(1)
        red = np.exp(m - m.max())
        red /= red.sum()
        return sp.lam * imp - (1.0 - sp.lam) * red

    # ------------------------------------------------------------------------ prefill

    def feed(self, tokens):
        """A chunk of tokens: one decode step for a single token, else a prefill chunk. Returns
        the logits [R][vocab] of the chunk's last token."""
        tokens = list(tokens)
        if len(tokens) == 1:
            return self.decode(tokens[0])
        n0 = self.n[0]
        kinds = [self.prefill_kind(r, len(tokens)) for r in range(self.R)]
        if (n0 == 0).all() and all(k == "append" for k in kinds) and self.R > 1:
            # every run starts empty and keeps the chunk whole: one computation (with h2o's
            # column sums, whatever run 0's policy), copied
            lg = self._prefill_run(0, tokens, colsum=True)
            for arr in [self.K, self.V, self.pos, self.vnorm, self.acc] + self.ptr + self.end:
                arr[:, 1:] = arr[:, :1]
            self.n[:, 1:] = self.n[:, :1]
            self.next[:, 1:] = self.next[:, :1]
            for r, sp in enumerate(self.specs):
                if sp.policy == "rkv":  # its window counts decode steps only (as _prefill_attn)
                    self.acc[:, r] = 0.0
            out = np.repeat(lg[None, :], self.R, 0)
        else:
            out = np.stack([self._prefill_run(r, tokens) for r in range(self.R)])
        self.t += len(tokens)
        return out

    def prefill_kind(self, r, n_tok):
        s, n0 = self.specs[r], int(self.n[0, r])
        if not s.evicts():
            if n0 + n_tok > s.budget:
                raise ContextFull("full policy: %d filled + %d new tokens exceed %d slots"
                                  % (n0, n_tok, s.budget))
            return "append"
        if n0 + n_tok <= s.budget - 1:
            return "append"
        return "compress" if n0 == 0 else "steps"

    def _prefill_run(self, r, tokens, colsum=False):
        m, s = self.m, self.specs[r]
        N = len(tokens)
        t0 = self.t
        kind = self.prefill_kind(r, N)
        x = m.embed[np.asarray(tokens)]
        positions = np.arange(t0, t0 + N)
        cs = m.rope_cs(positions)
        for l in range(self.L):
            h = m.rmsnorm(x, m.layers[l]["rms_att"])
            q, k, v = m.qkv(l, h, cs=cs)
            if kind == "steps":
                att = np.empty_like(q)
                for i in range(N):
                    att[i] = self.decode_attn(l, q[i:i + 1], k[i:i + 1], v[i:i + 1], t0 + i,
                                              np.array([r]))[0]
            else:
                att = self._prefill_attn(l, r, q, k, v, t0, kind == "compress", colsum)
            x = m.attn_out_mlp(l, x, att.reshape(N, -1))
        return m.logits(x[-1:])[0]

    def _prefill_attn(self, l, r, q, k, v, t0, compress, want_colsum=False):
        s = self.specs[r]
        want_colsum = want_colsum or s.policy == "h2o"
        H, G, D = self.H, self.G, self.D
        N = q.shape[0]
        n0 = int(self.n[l, r])
        gs = self.gsize[r]
        w_eff = s.snapkv_window()
        Lp = N - w_eff
        out = np.empty_like(q)
        colsum = np.zeros((H, n0 + N))
        keep = None
        kept_by_group = {}
        for g0 in range(0, H, gs):
            snap = np.zeros(max(Lp, 0))
            for g in range(g0, g0 + gs):
                keys = np.concatenate([self.K[l, r, g, :n0], k[:, g, :]], 0)   # [n0+N][D]
                vals = np.concatenate([self.V[l, r, g, :n0], v[:, g, :]], 0)
                vis = np.ones((N, n0 + N), dtype=bool)
                vis[:, n0:] = np.tril(np.ones((N, N), dtype=bool))
                for j in range(G):
                    hq = g * G + j
                    lg = (q[:, hq, :] @ keys.T) * self.scale
                    lg = np.where(vis, lg, -np.inf)
                    lg = lg - lg.max(1, keepdims=True)
                    e = np.exp(lg)
                    a = e / e.sum(1, keepdims=True)
                    out[:, hq, :] = a @ vals
                    if compress:
                        snap += a[Lp:, n0:n0 + Lp].astype(np.float64).sum(0)
                    if want_colsum:
                        colsum[g] += a.astype(np.float64).sum(0)
            if compress:
                kept_by_group[g0] = self._snapkv_select(s, N, Lp, w_eff, snap)
        for g in range(H):
            if compress:
                keep = kept_by_group[g - g % gs]
                idx = np.nonzero(keep)[0]
                nk = len(idx)
                self.K[l, r, g, :nk] = k[idx, g]
                self.V[l, r, g, :nk] = v[idx, g]
                self.pos[l, r, g, :nk] = t0 + idx
                self.vnorm[l, r, g, :nk] = np.abs(v[idx, g].astype(np.float64)).sum(-1).astype(np.float32)
                if want_colsum:
                    self.acc[l, r, g, :nk] = colsum[g, idx].astype(np.float32)
                self.pos[l, r, g, nk:] = -1
                new_slots, new_pos = np.arange(nk), t0 + idx
                n_after = nk
            else:
                if want_colsum:
                    self.acc[l, r, g, :n0] += colsum[g, :n0].astype(np.float32)
                    self.acc[l, r, g, n0:n0 + N] = colsum[g, n0:].astype(np.float32)
                self.K[l, r, g, n0:n0 + N] = k[:, g]
                self.V[l, r, g, n0:n0 + N] = v[:, g]
                self.pos[l, r, g, n0:n0 + N] = np.arange(t0, t0 + N)
                self.vnorm[l, r, g, n0:n0 + N] = np.abs(v[:, g].astype(np.float64)).sum(-1).astype(np.float32)
                new_slots, new_pos = np.arange(n0, n0 + N), np.arange(t0, t0 + N)
                n_after = n0 + N
            t_last = t0 + N - 1
            for ti, u in enumerate(self.uses):
                ok = new_pos < u.T
                if ok.any():
                    p, e = u.first_after(l, g, new_pos[ok], t_last)
                    self.ptr[ti][l, r, g, new_slots[ok]] = p
                    self.end[ti][l, r, g, new_slots[ok]] = e
            self.next[l, r, g] = -1
            if s.policy == "rkv":  # no selection yet; the observation window counts decode steps
                self.acc[l, r, g, :n_after] = 0.0
                self.rk_since[l, r] = -1
                self.rk_obs_on[l, r] = False
        self.n[l, r] = n_after
        return out

    @staticmethod
    def _snapkv_select(s, N, Lp, w_eff, snap):
        n_mid = s.budget - 1 - s.sink - w_eff
        keep = np.zeros(N, dtype=bool)
        keep[:s.sink] = True
        keep[Lp:] = True
        padded = np.concatenate([np.zeros(2), snap, np.zeros(2)])
        cand = []
        for j in range(s.sink, Lp):
            tot = 0.0
            for d in range(5):  # j-2 .. j+2, in that order
                tot += padded[j + d]
            cand.append((-(tot / 5.0), j))
        cand.sort()
        for _, j in cand[:n_mid]:
            keep[j] = True
        return keep

    # ------------------------------------------------------------------------ metrics

    def harm_rates(self):
        ev = np.maximum(self.evictions, 1)
        return self.harmful / ev, self.needed_later / ev
