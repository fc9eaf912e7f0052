"""The fragment arithmetic of the attention kernel's FP8 P·V (attn/attn_fwd_kernel.cuh, kPV8:
pv8_quantize, pv8_mma and the lane offset v_lane) replayed in Python on one warp: S's key order
(key_of), P's A fragment taken from the lane's own accumulators, V's B fragment from 8-byte loads
of the 128-byte-swizzled V tile, and the m16n8k32 MMA's fragment layout (PTX ISA) give P·V exactly;
the loads take the fewest shared-memory wavefronts. The formulas are copied from the kernel (a
change there must be made here too); the GPU tests (tests/gpu/test_pv_fp8_gpu.py) check the kernel
itself."""

from __future__ import annotations

import random

D = 64
BLOCK_N = 128


def key_of(j: int, g: int) -> int:
    return 64 * (j >> 3) + 32 * ((j >> 2) & 1) + 8 * (g >> 1) + 2 * (j & 3) + (g & 1)


def v_lane(g: int, t: int) -> int:
    return g * BLOCK_N + ((8 * t) ^ (g << 4))


def test_fragments_give_p_times_v():
    rnd = random.Random(1)
    p = [[rnd.randint(-8, 8) for _ in range(BLOCK_N)] for _ in range(16)]
    v = [[rnd.randint(-8, 8) for _ in range(D)] for _ in range(BLOCK_N)]
    smem = {d * BLOCK_N + (key ^ ((d & 7) << 4)): v[key][d] for d in range(D) for key in range(BLOCK_N)}
    o = [[0] * D for _ in range(16)]
    for c in range(BLOCK_N // 32):
        a = {}
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            s = {(j, e): p[g + 8 * (e >> 1)][key_of(j, 2 * t + (e & 1))] for j in range(16) for e in range(4)}
            j = 4 * c
            pa = [[s[j, 0], s[j, 1], s[j + 1, 0], s[j + 1, 1]], [s[j, 2], s[j, 3], s[j + 1, 2], s[j + 1, 3]],
                  [s[j + 2, 0], s[j + 2, 1], s[j + 3, 0], s[j + 3, 1]], [s[j + 2, 2], s[j + 2, 3], s[j + 3, 2], s[j + 3, 3]]]
            for i in range(4):  # a0: row g, k 4t+i; a1: row g+8; a2/a3: k 16+4t+i
                a[g, 4 * t + i], a[g + 8, 4 * t + i] = pa[0][i], pa[1][i]
                a[g, 16 + 4 * t + i], a[g + 8, 16 + 4 * t + i] = pa[2][i], pa[3][i]
        assert len(a) == 16 * 32
        for n in range(D // 8):
            b = {}
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                addr = n * 8 * BLOCK_N + (v_lane(g, t) ^ (32 * c))
                assert addr % 8 == 0
                for i in range(4):  # b0: col g, k 4t+i (the low word); b1: k 16+4t+i (the high one)
                    b[4 * t + i, g], b[16 + 4 * t + i, g] = smem[addr + i], smem[addr + 4 + i]
            assert len(b) == 32 * 8
            for r in range(16):
                for col in range(8):
                    o[r][8 * n + col] += sum(a[r, k] * b[k, col] for k in range(32))
    want = [[sum(p[r][key] * v[key][d] for key in range(BLOCK_N)) for d in range(D)] for r in range(16)]
    assert o == want


def test_v_loads_take_two_wavefronts():
    """32 lanes x 8 bytes: every bank holds at most two distinct words of a load (the minimum)."""
    for c in range(BLOCK_N // 32):
        words: dict[int, set[int]] = {}
        for lane in range(32):
            addr = v_lane(lane >> 2, lane & 3) ^ (32 * c)
            for w in (addr // 4, addr // 4 + 1):
                words.setdefault(w % 32, set()).add(w)
        assert max(len(s) for s in words.values()) == 2
