"""Validation of the public entry points' arguments (in Python, with messages naming the
argument) and the checked boolean keywords."""

from __future__ import annotations

import torch

from sageattn3 import reference

_QUANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def _check_tensor(x, name: str, dtypes, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be one of {names}, got {str(x.dtype).replace('torch.', '')}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")


def _check_qkv(q, k, v) -> None:
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        qs, ks = q.shape, k.shape
        if (q.dtype in _ATTN_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype and len(qs) == 4
                and len(ks) == 4 and v.shape == ks and ks[0] == qs[0] and ks[3] == qs[3] and qs[3] != 0
                and ks[1] != 0 and ks[2] != 0 and qs[1] % ks[1] == 0 and k.device == q.device
                and v.device == q.device):
            return  # the common case in one expression; anything else gets its message below
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(t, name, _ATTN_DTYPES)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: all must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: all must be on one device")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {q.shape[3]}")
    if q.shape[3] == 0:
        raise ValueError("q has head_dim 0")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a positive multiple of k/v heads ({k.shape[1]}) (GQA/MQA)"
        )
    if k.shape[2] == 0:
        raise ValueError("k and v have sequence length 0: attention needs at least one key")

def _flags(**named) -> tuple[bool, ...]:
    """The boolean keywords of a call, each checked (``reference.flag``: a string such as
    "False" or None is a TypeError, never silently true or false), in the order given."""
    values = tuple(named.values())
    for value in values:
        if type(value) is not bool:
            return tuple(reference.flag(value, name) for name, value in named.items())
    return values  # the common case: every one a bool already


def _search(qk_scale_search: bool | None, qk_rotation: bool) -> bool:
    """The scale search a call asked for, as a bool (None: ``reference.QK_SCALE_SEARCH``, or on
    with the rotation: ``reference.scale_search_on``)."""
    return reference.scale_search_on(qk_scale_search, qk_rotation)

