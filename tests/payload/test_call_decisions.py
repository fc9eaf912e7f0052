"""The one-op call (``sageattn3._call``) decides what the separate ops would have run: compared here,
without a GPU, by recording the ops each path calls (``_kernels.op`` replaced by recorders that give
the allocating ops their fakes' outputs) over the shapes, options, precisions, workspace limits and
scales a call can take. The kernels' own equality (one op against the separate ops, bit for bit) is
tests/gpu/test_call_gpu.py's."""

from __future__ import annotations

import itertools

import pytest
import torch

from sageattn3 import _attn, _call, _kernels, _pv8, _qk_choice, api

SHAPES = [(1, 4, 2, 300, 300, 64), (2, 6, 3, 129, 1100, 128), (1, 2, 2, 100, 50, 128), (1, 8, 1, 1000, 1000, 128),
          (1, 4, 2, 1, 300, 64)]  # 100 and 1 query rows: the short queries' limit (-1) and a single row's (the rule's)
OPTIONS = [{}, {"qk_rotation": True, "qk_scale_search": True}, {"qk_balance": True},
           {"qk_rotation": True, "qk_balance": True, "qk_scale_search": False}]


@pytest.fixture
def recorded(monkeypatch):
    """Every op call of ``api._fp4_attention`` on CPU tensors, as (name, args); the op path forced."""
    calls: list = []

    def op(name):
        fake = _kernels.ALLOCATING_OPS.get(name)

        def record(*args):
            calls.append((name, args))
            return fake(*args) if fake else None
        return record

    monkeypatch.setattr(_kernels, "op", op)
    monkeypatch.setattr(_pv8, "op", op)
    monkeypatch.setattr(_pv8, "check_v", lambda v, pad: None)
    monkeypatch.setattr(_qk_choice, "_rule_kernel_serves", lambda q, pre: True)
    monkeypatch.setattr(api, "_pv8_built", lambda: True)
    monkeypatch.setattr(_call, "serves", lambda q, k: True)
    return calls


def _run(calls, one: bool, *args, **kw):
    calls.clear()
    try:
        api._fp4_attention(*args, **kw, **({} if one else {"choice": []}))
    except (ValueError, TypeError) as e:
        return None, f"{type(e).__name__}: {e}"
    return list(calls), None


def _separate(calls) -> dict:
    """What the separate ops ran: the preprocessing's options, the modes, the kernels' arguments."""
    d = dict(calls)
    rule = d.get("qk_rule_select")
    (attn,) = [n for n, _ in calls if n.startswith("blockscaled")]
    a = d[attn]
    mx, vq = d.get("mxfp8_smooth_quant_qk"), d.get("quant_mxfp8_cols")
    return dict(pre=tuple(d["preprocess_qkv"][3:]), qk=0 if rule is None else (2 if rule[17] else 1),
                pv={"blockscaled_fp4_attn": 0, "blockscaled_attn_qk8": 0, "blockscaled_attn_pv8": 2,
                    "blockscaled_attn_mixed": 1}[attn], scale=a[-2], causal=a[-1], ws=a[11].numel(),
                rule=None if rule is None else (rule[13], rule[14], rule[15], rule[16], rule[18], rule[19], rule[20]),
                mxrot=None if mx is None else mx[8], vsel=None if vq is None else vq[1].numel() > 0)


def _one(calls) -> dict:
    """The same, from the one op's arguments (the delta_s workspace as the op carves it)."""
    assert [n for n, _ in calls] == ["attention_call"], calls
    q, k, v, causal, pbm, rot, bal, search, qk, pv, sm, rs, floor, lim, pvl, q16, wsl = calls[0][1]
    b, hq, sq, _ = q.shape
    row = -(-sq // 128) * (-(-k.shape[2] // 128) * 128)
    rows = min(b * hq, wsl // (4 * row)) if pbm and sq > 128 else 0
    return dict(pre=(128, pbm, rot, bal, search), qk=qk, pv=pv, scale=sm, causal=causal, ws=rows * row,
                rule=None if qk == 0 else (rs, rot, floor, lim, pvl if pv == 1 else -1.0, causal, q16),
                mxrot=None if qk == 0 else (1 if rot else 2), vsel=None if pv == 0 else pv == 1)


@pytest.mark.parametrize("mib", ["", "0", "1", "3"])
def test_the_one_op_runs_what_the_separate_ops_run(recorded, monkeypatch, mib):
    if mib:
        monkeypatch.setenv(_attn.WORKSPACE_ENV, mib)
    else:
        monkeypatch.delenv(_attn.WORKSPACE_ENV, raising=False)
    seen = set()
    for (b, hq, hk, sq, sk, d), opts, pbm, qk, pv, causal, sm, pv_limit in itertools.product(
            SHAPES, OPTIONS, (True, False), ("fp4", "auto", "fp8"), ("fp4", "auto", "fp8"), (False, True),
            (None, 0.05), (None, 0.0)):
        dt = torch.float16 if (sq + causal) % 2 else torch.bfloat16
        q, k = torch.zeros(b, hq, sq, d, dtype=dt), torch.zeros(b, hk, sk, d, dtype=dt)
        args, kw = (q, k, torch.zeros_like(k), causal, pbm, sm), dict(qk_precision=qk, pv_precision=pv,
                                                                     pv_limit=pv_limit, **opts)
        old, old_err = _run(recorded, False, *args, **kw)
        new, new_err = _run(recorded, True, *args, **kw)
        where = (mib, (b, hq, hk, sq, sk, d), opts, pbm, qk, pv, causal, sm, pv_limit)
        assert old_err == new_err, where
        if old_err is None:
            got = _one(new)
            assert _separate(old) == got, where
            seen.add((got["qk"], got["pv"], got["ws"] > 0))
    if mib != "0":
        assert {(1, 1, True), (2, 2, True), (0, 0, False), (0, 2, True)} <= seen, seen


def test_an_unresolved_scale_search_is_refused():
    q = torch.zeros(1, 2, 10, 64)
    with pytest.raises(TypeError, match="resolved bool"):
        _call.call(q, q, q, False, True, None, False, False, None, "auto", "auto", True, 0.1)


def test_the_head_dim_is_refused_before_the_workspace_limit_is_read(monkeypatch):
    """At a head dim without FP8 the reason is the head dim, whatever the workspace variable holds
    (the limit is not even read)."""
    from sageattn3 import reference

    monkeypatch.setenv(_attn.WORKSPACE_ENV, "not a number")
    never = lambda: pytest.fail("the workspace limit was read")  # noqa: E731
    assert _qk_choice.fp8_refusal(False, 96, never) == reference.fp8_unavailable(False, 96)
    assert _qk_choice.fp8_refusal(True, 128, lambda: False) == _attn.QK8_WORKSPACE_REFUSAL
    assert _qk_choice.fp8_refusal(False, 64, lambda: True) is None


def test_a_kept_plan_is_the_one_made_afresh(monkeypatch):
    """``_call.call`` keeps its decisions per call signature (the lengths through their 128-row
    blocks): over calls whose signatures collide or nearly do (lengths in the same blocks or the
    next, other kv heads, other dtypes, a scale given as a numpy scalar, other workspace limits),
    every call's op arguments equal those made with an empty cache; a NaN limit or scale is never
    kept."""
    import numpy as np

    args = []
    monkeypatch.setattr(_kernels, "op", lambda name: (lambda *a: args.append(a[3:])))
    rng = np.random.default_rng(0)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    for _ in range(40):  # a base call, then variations of it
        b, hq, d = pick([1, 2]), pick([2, 4]), pick([64, 128])
        flags = [bool(rng.random() < p) for p in (0.5, 0.7, 0.3, 0.3, 0.3, 0.8)]
        qk, pv, pvl = pick(["fp4", "auto", "fp8"]), pick(["fp4", "auto", "fp8"]), pick([0.0, 0.05])
        for _ in range(30):
            hk, sq, sk = pick([1, 2]), pick([1, 8, 127, 128, 129, 256, 257, 300]), pick([128, 1000, 100_000])
            q = torch.zeros(b, hq, sq, d, dtype=pick([torch.float16, torch.bfloat16]))
            k = torch.zeros(b, hk, sk, d, dtype=q.dtype)
            mib = pick(["", "0", "1"])  # 1 MiB: one 100,000-key row of 2 Q blocks fits, of 3 not
            if mib:
                monkeypatch.setenv(_attn.WORKSPACE_ENV, mib)
            else:
                monkeypatch.delenv(_attn.WORKSPACE_ENV, raising=False)
            call = (q, k, k, flags[0], flags[1], pick([None, 0.05, np.float64(0.05), np.array(0.05)]), flags[2],
                    flags[3], flags[4], qk, pv, flags[5], pvl)
            outcomes = []
            for fresh in (False, True):
                if fresh:
                    _call._PLANS.clear()
                args.clear()
                try:
                    _call.call(*call)
                    outcomes.append(args[0])
                except ValueError as e:
                    outcomes.append(str(e))
            assert outcomes[0] == outcomes[1], (b, hq, hk, sq, sk, d, mib, call[3:])
    # the lengths' blocks are in the key: at 1 MiB one delta_s row of 100,000 keys fits with 2 Q
    # blocks (the rule runs) and not with 3 (every head FP4), whatever came first
    monkeypatch.setenv(_attn.WORKSPACE_ENV, "1")
    k = torch.zeros(1, 2, 100_000, 128, dtype=torch.bfloat16)
    for order in ((256, 300), (300, 256)):
        modes = {}
        for sq in order:
            args.clear()
            _call.call(torch.zeros(1, 2, sq, 128, dtype=torch.bfloat16), k, k, False, True, None, False, False, False,
                       "auto", "auto", True, 0.05)
            modes[sq] = args[0][5]
        assert modes == {256: 1, 300: 0}, (order, modes)
    # the rule's limit is a knob users may set at run time: a call after a change takes the new one
    from sageattn3 import reference

    # the raw 16-bit rows' limit is off where K holds fewer rows than a TMA box (batch x heads x
    # sequence), whatever came first: 1 and 2 kv heads of 100 keys share every other part of the key
    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
    for order in ((1, 2), (2, 1)):
        _call._PLANS.clear()
        q16 = {}
        for hk in order:
            k = torch.zeros(1, hk, 100, 128, dtype=torch.bfloat16)
            args.clear()
            _call.call(q, k, k, False, True, None, False, False, False, "auto", "auto", True, 0.05)
            q16[hk] = args[0][12]
        assert q16 == {1: -1.0, 2: reference.QK16_STAT_LIMIT}, (order, q16)

    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
    for limit in (0.2, 0.3, 0.2):
        monkeypatch.setattr(reference, "AUTO_ERROR_LIMIT", limit)
        args.clear()
        _call.call(q, q, q, False, True, None, False, False, False, "auto", "auto", True, 0.05)
        assert args[0][10] == limit, (limit, args[0])
        # a short query (2 to 127 rows) takes -1, every head FP8; one row and 128 the rule's limit,
        # though 1, 8 and 127 rows share one 128-row block of the key
        for sq in (1, 8, 127, 128, 1):
            args.clear()
            qs = torch.zeros(1, 2, sq, 128, dtype=torch.bfloat16)
            _call.call(qs, q, q, False, True, None, False, False, False, "auto", "auto", True, 0.05)
            assert args[0][10] == (-1.0 if 1 < sq < 128 else limit), (sq, limit, args[0])
    for bad in ({"sm_scale": float("nan")}, {"pv_limit": float("nan")}):
        _call._PLANS.clear()
        q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
        kw = {"sm_scale": None, "pv_limit": 0.05, **bad}
        for _ in range(3):
            _call.call(q, q, q, False, True, kw["sm_scale"], False, False, False, "auto", "auto", True, kw["pv_limit"])
        assert not _call._PLANS, bad
