"""Pure-PyTorch reference of everything sageattn3 computes: the oracle of the kernel tests.

Runs on any device (CPU included); everything is computed in float32.

The modules, each importing only those before it:

- ``formats``: NVFP4 (rows and transposed; the bit-exact definition is there), K's float16
  quantization residual, MXFP8.
- ``transforms``: the Q/K rotation, the channel balance, the sampled blocks of the means.
- ``precision``: the Q·Kᵀ precision per head (the "auto" rule).
- ``preprocessing``: the means, the smoothing, ``Preprocessed`` / ``preprocess``, ``delta_s``.
- ``attention``: ``exact_attention``, ``sageattn3``, ``sageattn3_paper``.

Every name is used from here: ``sageattn3.reference.quantize_rows``.

The quantized attention (``sageattn3``)
----------------------------------------
See ``rotate``, ``preprocess`` / ``Preprocessed`` and ``sageattn3`` for the exact definition of
the Q/K rotation, the smoothing, the correction ``delta_s`` and the two-level quantization of P;
``sageattn3_paper`` is the published algorithm, for comparison.

Knobs
-----
The four settings below are read on every call, from this package, by the modules that use
them: ``sageattn3.reference.QK_SCALE_SEARCH = True`` changes every later call that does not say.
"""

from __future__ import annotations

from .formats import (
    BLOCK,
    E2M1_VALUES,
    E4M3_MAX,
    F16_MAX,
    FP4_MAX,
    MX_BLOCK,
    RESIDUAL_UNIT,
    UE8M0_BIAS,
    UE8M0_MAX_BYTE,
    UE8M0_MIN_BYTE,
    block_sq_error,
    dequantize_mxfp8_rows,
    dequantize_qk_rows,
    mxfp8_p,
    dequantize_mxfp8_transposed,
    dequantize_rows,
    dequantize_transposed,
    dequantize_transposed_tiled,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_scale_byte,
    pack_codes,
    pad_dim,
    qk16_rows,
    QK16_HEAD_DIM,
    QK16_RAW_HEAD_DIM,
    quantize_mxfp8_rows,
    quantize_mxfp8_transposed,
    quantize_residual,
    quantize_rows,
    quantize_transposed,
    quantize_transposed_tiled,
    v_tile_exponents,
    V_GROUP,
    V_TILE,
    V_TILE_EXP_MAX,
    residual_scales,
    ue8m0_scale_byte,
    ue8m0_value,
    unpack_codes,
)
from .transforms import (
    BALANCE_HEAD_DIMS,
    BALANCE_MAX_EXP,
    Q_MEAN_BLOCK,
    QK_BALANCE_DEFAULT,
    QK_ROTATION_DEFAULT,
    ROTATION_HEAD_DIMS,
    ROTATION_SCALE,
    ROTATION_SIGN_BITS,
    balance_applies,
    balance_exponents,
    expand_kv,
    flag,
    rotate,
    unrotate,
    rotation_applies,
    rotation_score_factor,
    rotation_signs,
    sample_blocks,
    sample_mean,
    scale_search_applies,
    scale_search_on,
)
from .precision import (
    FP8_HEAD_DIMS,
    PV_PRECISION_DEFAULT,
    PV_PRECISIONS,
    QK_PRECISION_DEFAULT,
    QK_PRECISIONS,
    choose_qk16,
    choose_qk_precision,
    rule_limit,
    fp8_applies,
    fp8_unavailable,
    pv_precision_arg,
    pv_p_error,
    choose_pv_precision,
    options_free_means,
    qk16_stat,
    qk_fp4_error,
    query_stride,
    spread_bound,
    rule_has_options,
    qk_precision_arg,
)
from .preprocessing import (
    Preprocessed,
    delta_s,
    fp8_rows,
    k_block_correction,
    k_block_means,
    k_mean,
    preprocess,
    raw16_fits,
    q_block_index,
    q_mean,
    smooth_q,
)
from .treatments import (
    BALANCE,
    PV_FP8,
    QK_FP8,
    ROTATION,
    SCALE_SEARCH,
    TREATMENT_SETS,
    TREATMENTS,
    choose_treatments,
    treatment_applies,
    treatment_errors,
    treatment_kwargs,
    treatment_names,
    treatment_set,
)
from .attention import (
    LOG2E,
    P_SCALE,
    _dequantized as _dequantized,  # the tests emulate the kernel from these two
    _tiled_attention as _tiled_attention,
    cosine_similarity,
    exact_attention,
    sageattn3,
    sageattn3_paper,
    sageattn3_treated,
)

# ---------------------------------------------------------------------------------------------
# Knobs (read per call by transforms and precision: set them here)
# ---------------------------------------------------------------------------------------------

# Whether the preprocessing quantizes Q and K (head dims 64/128) with the scale search
# (``quantize_rows``) where a call does not say (``qk_scale_search=None``, the default of
# ``preprocess`` / ``sageattn3_blackwell`` here and in the package): read on every such call, by
# the kernels and this reference alike. Off by default: measured on an H100 (the MMA-model test
# flavour, 24 heads x 32k tokens, D 128, bf16, back to back) it makes the whole preprocessing
# 0.382-0.383 -> 0.705-0.710 ms (+85%: every block is converted twice, in software on that GPU) for a
# cos-sim gain of about 0.002 on random data and 0.005-0.01 with Q outlier channels (README,
# "Accuracy"). Set it to True (or pass qk_scale_search=True) for the most accurate quantization
# of Q and K. A call with qk_rotation=True that does not say takes the scale search whatever
# this is (``scale_search_on``).
QK_SCALE_SEARCH = False
# K's mean and Q's mean over the whole sequence (mean_q_global, and Q's only mean without
# per_block_mean) come from up to this many evenly spaced 128-token blocks (``sample_blocks``).
# The attention does not depend on them: any vector subtracted from K changes every score of a
# query row by the same amount (the softmax ignores it), and mean_q_global only splits the
# correction delta_s (exact for any value). They decide how well a channel bias is removed before
# the quantization; a sample does that as well as the whole sequence on data whose bias is a
# property of the channel, and it lets the kernels know the means before they read Q and K, so
# each is read once.
MEAN_SAMPLE_BLOCKS = 8
# The rule reads every AUTO_QUERY_STRIDE-th query row of Q's sampled blocks (``sample_blocks``:
# up to 8 x 16 rows) against every key of K's sampled blocks (up to 1024 keys); a shorter call,
# every 4th, 2nd or every row, as long as its rows times its keys stay within 1.5 times that
# (``query_stride``).
AUTO_QUERY_STRIDE = 8
# A head takes FP8 Q·Kᵀ when the rule's estimate of the relative output error FP4 Q·Kᵀ causes
# (``qk_fp4_error``) exceeds this. Calibrated on tests/attention_cases.py
# (docs/accuracy-auto-details.md, "The rule"; 4 heads, 512 tokens, D 128 and 64, seed 2025): the
# heads of zero-mean data, channel offsets, K biases and drifting offsets estimate 0.005-0.16 (FP4
# Q·Kᵀ costs them little: the FP4 error of P and V dominates there), those of outlier channels,
# near-one-hot rows, RoPE'd biased keys and a huge K channel 0.25-0.71 (the plain ratio; the
# estimate adds the sample's spread, ``precision.AUTO_ERROR_SPREAD``).
AUTO_ERROR_LIMIT = 0.2
# Calls of 2 to AUTO_SHORT_QUERY_ROWS - 1 query rows: "auto" gives every head FP8 Q·Kᵀ (the rule's
# limit -1, ``rule_limit``). Few rows make Q's mean a large part of every score, which the
# estimate leaves out (it compares the scores of the smoothed rows), and few rows to sample: at
# 2-96 query rows against 512-4096 keys the estimate put heads of outlier channels and massive
# outliers at 0.000-0.199 that FP4 Q·Kᵀ left at 0.32-0.98 (docs/accuracy-auto-details.md, "Short
# queries"). One row is exact in FP4: it is its own mean, all of it in the fp32 correction.
AUTO_SHORT_QUERY_ROWS = 128
# A head's P·V runs in MXFP8 (pv_precision "auto", the default) when the rule's estimate of the
# relative output error NVFP4 P·V causes (``pv_p_error``: P's, or V's share over PV_V_FACTOR; V's
# share at most 0.087 after the factor on every other case of tests/attention_cases.py, 0.59-0.67
# on v_sink, sinks whose V is 1/30 of the others') exceeds this. P's part calibrated on
# tests/attention_cases.py (docs/accuracy-auto-details.md, "The P·V choice"; 4 q heads over 2, D 64
# and 128, six seeds):
# zero-mean heads (randn, k_bias, mixed_heads' first) estimate 0.087-0.101 at 256-4096 tokens, the
# most of any case that needs no FP8 P·V (every other case stays below 0.07); the large-logit fp16
# heads 0.093-0.34 at 1024 tokens. For a causal call the estimate masks the keys each sampled row
# does not see: zero-mean heads then estimate at most 0.075 and the large-logit heads whose NVFP4
# P·V output falls below cos 0.98 against exact attention (causal) 0.13 and up (seed 6's head that
# the unmasked estimate put at 0.097: 0.191). The margin of non-causal calls is thin on both sides
# (docs/accuracy-auto-details.md, "The P·V choice").
PV_ERROR_LIMIT = 0.105
# At D 128 a head that leaves FP4 multiplies its raw 16-bit rows (Q·Kᵀ from the fp16/bf16 inputs as
# they are: ``Preprocessed.qk16``) instead of MXFP8 rows when ``qk16_stat``, the scale of MXFP8's
# logit error (the softmax scale times the RMS norms of the smoothed rows over the rule's sample,
# over sqrt(D); K's first sampled block), exceeds this. Calibrated at D 128, 1024 tokens, 4 q heads
# over 2, seeds 2025 and 0-7 (docs/accuracy-auto-details.md, "The raw 16-bit rows at D 128"): the 16
# cases of tests/attention_cases.py measure at most 10.7 but for the massive-outlier heads (35.9-48.3,
# MXFP8 0.972-0.992 there); zero-mean Gaussian Q and K scaled up, the statistic's growth alone, leave
# MXFP8 at 0.9834 at 14.4 and 0.9805 at 17.5 (0.98 near 18.5), so 15.
QK16_STAT_LIMIT = 15.0
# The raw rows go in 128-row TMA boxes over the inputs' rows: a call with fewer rows of Q or of K
# (batch x heads x sequence) keeps MXFP8 for those heads.
QK16_MIN_ROWS = 128
# The per-head treatments (opt-in, reference only, not wired into any default): a head keeps the
# treatments it is given (its floors: none without options) where ``treatment_errors`` estimates
# the relative output error of plain FP4 and of its floors at most TREATMENT_KEEP_LIMIT (zero-mean
# heads: 0.18-0.21); otherwise ``choose_treatments`` adds the cheapest treatments whose estimate
# is at most TREATMENT_ERROR_LIMIT (0.18: cos-sim 0.98 with the estimate's ~10% noise).
# Calibration: docs/accuracy-auto-details.md, "Treatments per head".
TREATMENT_ERROR_LIMIT = 0.18
TREATMENT_KEEP_LIMIT = 0.23

__all__ = [
    "AUTO_ERROR_LIMIT",
    "AUTO_SHORT_QUERY_ROWS",
    "AUTO_QUERY_STRIDE",
    "BALANCE",
    "BALANCE_HEAD_DIMS",
    "BALANCE_MAX_EXP",
    "BLOCK",
    "E2M1_VALUES",
    "E4M3_MAX",
    "F16_MAX",
    "FP4_MAX",
    "FP8_HEAD_DIMS",
    "LOG2E",
    "MEAN_SAMPLE_BLOCKS",
    "MX_BLOCK",
    "PV_FP8",
    "PV_PRECISIONS",
    "PV_PRECISION_DEFAULT",
    "P_SCALE",
    "Preprocessed",
    "QK_BALANCE_DEFAULT",
    "QK_FP8",
    "QK_PRECISIONS",
    "QK_PRECISION_DEFAULT",
    "QK_ROTATION_DEFAULT",
    "QK_SCALE_SEARCH",
    "Q_MEAN_BLOCK",
    "RESIDUAL_UNIT",
    "ROTATION",
    "ROTATION_HEAD_DIMS",
    "ROTATION_SCALE",
    "ROTATION_SIGN_BITS",
    "SCALE_SEARCH",
    "TREATMENTS",
    "TREATMENT_ERROR_LIMIT",
    "TREATMENT_KEEP_LIMIT",
    "TREATMENT_SETS",
    "UE8M0_BIAS",
    "UE8M0_MAX_BYTE",
    "UE8M0_MIN_BYTE",
    "balance_applies",
    "balance_exponents",
    "block_sq_error",
    "choose_qk16",
    "choose_qk_precision",
    "rule_limit",
    "choose_treatments",
    "cosine_similarity",
    "delta_s",
    "dequantize_mxfp8_rows",
    "dequantize_qk_rows",
    "mxfp8_p",
    "dequantize_mxfp8_transposed",
    "dequantize_rows",
    "dequantize_transposed",
    "dequantize_transposed_tiled",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_scale_byte",
    "exact_attention",
    "expand_kv",
    "flag",
    "fp8_applies",
    "fp8_rows",
    "fp8_unavailable",
    "k_block_correction",
    "k_block_means",
    "k_mean",
    "pack_codes",
    "pad_dim",
    "preprocess",
    "pv_precision_arg",
    "pv_p_error",
    "choose_pv_precision",
    "PV_ERROR_LIMIT",
    "QK16_MIN_ROWS",
    "QK16_STAT_LIMIT",
    "q_block_index",
    "q_mean",
    "options_free_means",
    "qk_fp4_error",
    "spread_bound",
    "query_stride",
    "rule_has_options",
    "qk_precision_arg",
    "qk16_rows",
    "qk16_stat",
    "raw16_fits",
    "QK16_HEAD_DIM",
    "QK16_RAW_HEAD_DIM",
    "quantize_mxfp8_rows",
    "quantize_mxfp8_transposed",
    "quantize_residual",
    "quantize_rows",
    "quantize_transposed",
    "quantize_transposed_tiled",
    "v_tile_exponents",
    "V_GROUP",
    "V_TILE",
    "V_TILE_EXP_MAX",
    "residual_scales",
    "rotate",
    "unrotate",
    "rotation_applies",
    "rotation_score_factor",
    "rotation_signs",
    "sageattn3",
    "sageattn3_paper",
    "sageattn3_treated",
    "sample_blocks",
    "sample_mean",
    "scale_search_applies",
    "scale_search_on",
    "smooth_q",
    "treatment_applies",
    "treatment_errors",
    "treatment_kwargs",
    "treatment_names",
    "treatment_set",
    "ue8m0_scale_byte",
    "ue8m0_value",
    "unpack_codes",
]
