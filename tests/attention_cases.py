"""Hard attention inputs for the accuracy tests and the accuracy table (tests/bench/accuracy.py):
the distributions real models give FP4 attention trouble with, as seeded generators. Shared by
the CPU reference tests (tests/payload), the GPU tests (tests/gpu) and the table script.

Every case starts from i.i.d. standard normal Q, K, V and adds one kind of structure:

- ``randn``: nothing (zero-mean Q, K, V: flat softmax, zero-mean output, FP4's worst relative case).
- ``q_offset_x1`` / ``_x3`` / ``_x8``: Q gets a per-channel offset (the same for every token) of
  scale 1, 3, 8; K one of scale 3, V one of scale 2 (what smoothing removes; x1 is the data the
  payload tests have always used).
- ``q_outliers``: four Q channels scaled by 8, 12, 16 and 20 (varying sign: no offset to remove).
- ``k_outliers``: the same for four K channels.
- ``qk_outliers``: the same four channels scaled in Q and in K (outliers both share).
- ``k_bias``: K gets a per-channel bias of scale 8.
- ``peaky``: Q scaled by 4: near-one-hot softmax rows.
- ``zero_mean_v``: Q/K offsets as x3, V left zero-mean.
- ``q_drift``: Q's channel offset drifts linearly along the sequence, from -8 to +8 times one
  random direction (Q's 128-token block means move, as when RoPE follows a channel offset); K
  and V offsets as x8.
- ``rope_bias``: Q and K get per-channel offsets of scale 3 (Q) and 5 (K), then rotary position
  embedding (``rope``: channel pairs (i, i + D/2) turned by position x 10000^(-2i/D)), the usual
  LLM layout: K's bias turns with the position, so one mean over the sequence no longer removes
  it.
- ``k_sink``: one huge constant K channel (value 40 on every key, and Q's same channel x6), and
  the first four keys (attention sinks) aligned with Q's offset direction (x6), Q offset x1.
- ``qk_massive``: massive activations shared by Q and K: three channels scaled by 20, 40 and 60
  in both (varying sign, as ``qk_outliers`` but 2.5-3x larger): every row is near one-hot and
  its argmax hangs on the outlier channels' products.
- ``large_logits`` (fp16 unless a dtype is given): Q = 0.5 x noise + a channel offset mu (x1),
  and four sink keys at the start, K += 11 / sqrt(D) x mu, whose scores before the softmax scale
  are ~11 sqrt(D) (about 90-125) against the others' tens; V of large magnitude (x30), the
  sinks' V zero (sinks carry no value). Each row's max is a sink, and the output comes from the
  other keys, whose P is ~e^-11 of the row max: P's quantization error dominates (the scores
  are mostly the exact correction mean_q · K).
- ``v_sink``: attention sinks that carry a small value: Q = noise + a channel offset mu, four
  sink keys at the start with K += 12 / sqrt(D) x mu (scores 12 e-folds above the others after
  the softmax scale), V x30 but the sinks' V x1. The sinks take nearly all of each row's P, so the
  output is mostly their V, which sits at 1/30 of its 16-key blocks' largest value: NVFP4 V
  rounds it to zero (V's error dominates; FP8 P·V keeps it).
- ``mixed_heads``: heads of different kinds in one call (4 q heads over 2 kv heads expected):
  kv head 0 zero-mean, its q heads zero-mean and near-one-hot (x4); kv head 1 and its q heads
  from ``rope_bias``. Other head counts: q head h takes the kind of h % 4.

Shapes (GQA, ragged lengths, causal long rows) are chosen by the caller.
"""

from __future__ import annotations

import torch

CASES = ("randn", "q_offset_x1", "q_offset_x3", "q_offset_x8", "q_outliers", "k_outliers", "qk_outliers", "k_bias",
         "peaky", "zero_mean_v", "q_drift", "rope_bias", "k_sink", "mixed_heads", "qk_massive", "large_logits",
         "v_sink")
# The cases FP4 Q·Kᵀ alone fails on (issue targets: RoPE'd >= 0.98, outliers >= 0.98, near-one-hot
# >= 0.97 with the defaults) and those where no head needs help.
HARD_CASES = ("q_outliers", "k_outliers", "qk_outliers", "peaky", "rope_bias", "k_sink", "mixed_heads")
EASY_CASES = ("randn", "q_offset_x1", "q_offset_x3", "q_offset_x8", "k_bias", "zero_mean_v", "q_drift")
# Hard cases the defaults leave below 0.98 whatever the Q·Kᵀ precision (the per-head treatments,
# tests/bench/treatments.py): massive outliers Q and K share, and large logits whose P's FP4
# error dominates.
TREATMENT_CASES = ("qk_massive", "large_logits")
# The cases whose P·V needs MXFP8 (the rule's P·V estimate sends their heads there): P's error
# (large logits) or V's (sinks whose V is small).
PV_CASES = ("large_logits", "v_sink")
V_SINK_SCORE = 12.0  # v_sink: the sinks' extra score after the softmax scale (in e-folds)
ROPE_BASE = 10000.0
OUTLIER_SCALES = (8.0, 12.0, 16.0, 20.0)
MASSIVE_SCALES = (20.0, 40.0, 60.0)
SINK_SCORE = 11.0  # large_logits: the sinks' extra score after the softmax scale (in e-folds)
# The dtype a case is made in where the caller gives none.
CASE_DTYPE = {"large_logits": torch.float16}


def make(case: str, b: int, hq: int, hk: int, sq: int, sk: int, d: int, *, seed: int = 0,
         dtype: torch.dtype | None = None, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, hq, sq, d), k and v (b, hk, sk, d) of ``case`` in ``dtype`` (None: the case's own,
    ``CASE_DTYPE``, else bf16) on ``device`` (generated on the CPU, so a seed gives the same inputs
    everywhere)."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}: one of {', '.join(CASES)}")
    if dtype is None:
        dtype = CASE_DTYPE.get(case, torch.bfloat16)
    if case == "mixed_heads":
        return _mixed_heads(b, hq, hk, sq, sk, d, seed=seed, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hk, sk, d, generator=g)
    v = torch.randn(b, hk, sk, d, generator=g)
    offsets = [torch.randn(d, generator=g) for _ in range(3)]
    if case.startswith("q_offset_x"):
        q = q + float(case.removeprefix("q_offset_x")) * offsets[0]
        k = k + 3 * offsets[1]
        v = v + 2 * offsets[2]
    elif case in ("q_outliers", "k_outliers", "qk_outliers"):
        channels = torch.randperm(d, generator=g)[: len(OUTLIER_SCALES)]
        if case != "k_outliers":
            q[..., channels] *= torch.tensor(OUTLIER_SCALES)
        if case != "q_outliers":
            k[..., channels] *= torch.tensor(OUTLIER_SCALES)
    elif case == "k_bias":
        k = k + 8 * offsets[1]
    elif case == "peaky":
        q = 4 * q
    elif case == "zero_mean_v":
        q = q + 3 * offsets[0]
        k = k + 3 * offsets[1]
    elif case == "q_drift":
        q = q + 8 * torch.linspace(-1.0, 1.0, sq)[:, None] * offsets[0]
        k = k + 3 * offsets[1]
        v = v + 2 * offsets[2]
    elif case == "rope_bias":
        q = rope(q + 3 * offsets[0])
        k = rope(k + 5 * offsets[1])
    elif case == "k_sink":
        c = int(torch.randint(d, (1,), generator=g))
        q = q + offsets[0]
        q[..., c] *= 6.0
        k[..., c] = 40.0
        k[..., :4, :] += 6.0 * offsets[0]
    elif case == "qk_massive":
        channels = torch.randperm(d, generator=g)[: len(MASSIVE_SCALES)]
        q[..., channels] *= torch.tensor(MASSIVE_SCALES)
        k[..., channels] *= torch.tensor(MASSIVE_SCALES)
    elif case == "large_logits":
        q = 0.5 * q + offsets[0]
        k[..., :4, :] += SINK_SCORE / d**0.5 * offsets[0]
        v = 30.0 * v
        v[..., :4, :] = 0.0
    elif case == "v_sink":
        q = q + offsets[0]
        k[..., :4, :] += V_SINK_SCORE / d**0.5 * offsets[0]
        v = 30.0 * v
        v[..., :4, :] /= 30.0
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (..., S, D) (float32): channel pairs (i, i + D/2) rotated by
    the angle position x ROPE_BASE^(-2i/D)."""
    s, d = x.shape[-2], x.shape[-1]
    half = d // 2
    freq = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) * 2.0 / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def _mixed_heads(b: int, hq: int, hk: int, sq: int, sk: int, d: int, *, seed: int, dtype, device):
    """``mixed_heads``: q head h of kind h % 4 (zero-mean, near-one-hot, RoPE'd, RoPE'd), each kv
    head from the kind of its first q head."""
    rand = make("randn", b, hq, hk, sq, sk, d, seed=seed, dtype=torch.float32)
    roped = make("rope_bias", b, hq, hk, sq, sk, d, seed=seed + 1, dtype=torch.float32)
    q, k, v = rand[0].clone(), rand[1].clone(), rand[2].clone()
    rep = hq // hk
    for h in range(hq):
        kind = h % 4
        if kind == 1:
            q[:, h] = 4 * rand[0][:, h]
        elif kind >= 2:
            q[:, h] = roped[0][:, h]
    for h in range(hk):
        if (h * rep) % 4 >= 2:
            k[:, h], v[:, h] = roped[1][:, h], roped[2][:, h]
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum |a - b| / sum |b| (float64)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().sum() / b.abs().sum().clamp_min(1e-300))


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))
