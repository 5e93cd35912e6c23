"""Red team exact truth (mpmath, 300 digits; imports nothing from draftcert): acceptance of
each built-in rule on the given values, and the brute-force forward-KL radius (small V)."""

import math

import mpmath

mp = mpmath.mp
mp.dps = 300
def P_exact(row, is_logits):
    v = [float(x) for x in row]
    if is_logits:
        m = max(v)
        e = [mp.e**(mp.mpf(x)-m) if x != -math.inf else mp.mpf(0) for x in v]
        s = mp.fsum(e)
        return [x/s for x in e]
    s = mp.fsum([mp.mpf(x) for x in v])
    return [mp.mpf(x)/s for x in v]
def argmax_low(vals):
    v = [float(x) for x in vals]; m = max(v); return v.index(m)
def H(P): return -mp.fsum([p*mp.log(p) for p in P if p > 0])
def Ht(P): return -mp.fsum([p*mp.log(p+mp.mpf(1e-5)) for p in P])
def accept(spec, row, is_logits, x, qrow=None):
    P = P_exact(row, is_logits)
    vals = [float(t) for t in row]
    name, *par = spec.split(":")
    px = P[x]; p1 = max(P)
    if name == "strict": return vals[x] == max(vals)
    if name == "topm":
        M = int(par[0]); srt = sorted(vals, reverse=True); return vals[x] >= srt[min(M, len(vals))-1]
    if name == "additive": return px >= p1 - mp.mpf(float(par[0]))
    if name == "relaxed":
        M = int(par[0]); srt = sorted(vals, reverse=True)
        return vals[x] >= srt[min(M, len(vals))-1] and px >= p1 - mp.mpf(float(par[1]))
    if name == "multiplicative": return px >= mp.mpf(float(par[0]))*p1
    if name == "entropy":
        tau = min(mp.mpf(float(par[0])), mp.mpf(float(par[1]))*mp.e**(-H(P))); return px > tau
    if name == "typical":
        tau = min(mp.mpf(float(par[0])), mp.mpf(float(par[1]))*mp.e**(-Ht(P))); return px > tau
    if name == "mars":
        srt = sorted(vals, reverse=True)
        Ps = sorted(P, reverse=True)
        if vals[x] == srt[0]: return True
        close = (mp.log(Ps[0]) - mp.log(Ps[1])) <= mp.mpf(float(par[0]))
        return bool(close) and px >= Ps[1]
    if name == "tree":
        M = int(par[0]); a = argmax_low(vals); q = [float(t) for t in qrow]
        ahead = sum(1 for i in range(len(q)) if q[i] > q[a] or (q[i] == q[a] and i < a))
        return ahead < M
    raise KeyError(spec)
def rejected_set(spec, row, is_logits):
    return [y for y in range(len(row)) if not accept(spec, row, is_logits, y)]
def radius_fwd(spec, row, is_logits):
    P = P_exact(row, is_logits); V = len(P)
    R = rejected_set(spec, row, is_logits)
    best = mp.inf
    for y in R:
        others = sorted([i for i in range(V) if i != y], key=lambda i: -P[i])
        for j in range(0, V):
            J = others[:j] + [y]; S = mp.fsum([P[i] for i in J]); L = S/len(J)
            rest = others[j:]
            if rest and P[rest[0]] > L: continue
            c = mp.fsum([P[i]*mp.log(P[i]/L) for i in J if P[i] > 0])
            best = min(best, c); break
    return best
def kl_fwd(row, is_l, qrow, q_l):
    P = P_exact(row, is_l); Q = P_exact(qrow, q_l)
    s = mp.mpf(0)
    for p, q in zip(P, Q):
        if p > 0:
            if q == 0: return mp.inf
            s += p*mp.log(p/q)
    return s
