"""The workspace of delta_s per query block and key (sageattn3._attn.delta_s_workspace): its size
from the shapes and SAGEATTN3_DELTA_S_WORKSPACE_MIB, and the error for a bad value. CPU only: the
workspace is an ordinary torch tensor, allocated on whatever device the caller names."""

import pytest
import torch

from sageattn3 import _attn

ENV = "SAGEATTN3_DELTA_S_WORKSPACE_MIB"
CPU = torch.device("cpu")


def test_default_limit_holds_every_head_at_32k(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert _attn.delta_s_workspace_limit() == 512 << 20
    # 32k tokens: 256 query blocks x 32768 keys x 4 bytes = 32 MiB per (batch, head); 16 heads fit
    w = _attn.delta_s_workspace(1, 16, 256, 32768, 32768, CPU)
    assert w.dtype == torch.float32 and w.numel() * 4 == 16 * (32 << 20)


def test_chunks_of_heads_and_the_bounded_mode(monkeypatch):
    monkeypatch.setenv(ENV, "100")  # 3 rows of 32 MiB
    assert _attn.delta_s_workspace(2, 24, 256, 32768, 32768, CPU).numel() * 4 == 3 * (32 << 20)
    # 128k tokens: 512 MiB per head, more than the limit: no workspace (the kernel's in-loop correction)
    assert _attn.delta_s_workspace(1, 1, 1024, 131072, 131072, CPU).numel() == 0
    monkeypatch.setenv(ENV, "512")
    assert _attn.delta_s_workspace(1, 1, 1024, 131072, 131072, CPU).numel() * 4 == 512 << 20
    monkeypatch.setenv(ENV, "0")
    assert _attn.delta_s_workspace(1, 16, 32, 4096, 4096, CPU).numel() == 0
    # the rows are ceil(seq_q/128) query blocks long, however far seq_q is padded
    monkeypatch.delenv(ENV)
    assert _attn.delta_s_workspace(1, 1, 4, 300, 512, CPU).numel() == 3 * 512


def test_one_q_mean_needs_none(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert _attn.delta_s_workspace(4, 32, 1, 8192, 8192, CPU).numel() == 0


@pytest.mark.parametrize("bad", ["-1", "1.5", "lots", "512MiB"])
def test_bad_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(ValueError, match=f"{ENV}=.*whole number of MiB >= 0.*{ENV}=512"):
        _attn.delta_s_workspace(1, 1, 2, 256, 256, CPU)


def test_a_limit_handed_in_replaces_the_variable(monkeypatch):
    """The FP4 path reads the variable once per call and hands the limit to the rule and the
    attention: a limit passed in is what sizes the workspace, whatever the variable says."""
    monkeypatch.setenv(ENV, "0")
    assert _attn.delta_s_workspace(2, 24, 256, 32768, 32768, CPU, 100 << 20).numel() * 4 == 3 * (32 << 20)
    assert _attn.fp8_workspace_fits(1, 1, 256, 32768, 32768, 32 << 20)
    assert not _attn.fp8_workspace_fits(1, 1, 256, 32768, 32768, (32 << 20) - 1)
    assert not _attn.fp8_workspace_fits(1, 1, 256, 32768, 32768)  # the variable's 0
    monkeypatch.setenv(ENV, "lots")  # not read when a limit is handed in
    assert _attn.delta_s_workspace(1, 1, 2, 256, 256, CPU, 1 << 20).numel() == 2 * 256
