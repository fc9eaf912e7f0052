"""The reference's knobs: set on the package (``sageattn3.reference.X = value``), they change
every later call, whichever submodule reads them."""

import pytest
import torch

from sageattn3 import reference as ref

import attention_cases as ac

KNOBS = ("QK_SCALE_SEARCH", "MEAN_SAMPLE_BLOCKS", "AUTO_QUERY_STRIDE", "AUTO_ERROR_LIMIT", "AUTO_SHORT_QUERY_ROWS")
SUBMODULES = (ref.formats, ref.transforms, ref.precision, ref.preprocessing, ref.attention)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_qk_scale_search_set_on_the_package_changes_preprocess():
    """``reference.QK_SCALE_SEARCH = True`` makes ``reference.preprocess`` (qk_scale_search=None)
    quantize Q and K with the scale search: what qk_scale_search=True computes, not the default."""
    q, k, v = ac.make("randn", 1, 2, 1, 300, 300, 64, seed=3)
    plain = ref.preprocess(q, k, v)
    searched = ref.preprocess(q, k, v, qk_scale_search=True)
    assert ref.QK_SCALE_SEARCH is False and plain.qk_scale_search is False
    ref.QK_SCALE_SEARCH = True
    try:
        by_knob = ref.preprocess(q, k, v)
    finally:
        ref.QK_SCALE_SEARCH = False
    assert by_knob.qk_scale_search is True
    for name in ("q_packed", "q_scales", "k_packed", "k_scales"):
        got = _bytes(getattr(by_knob, name))
        assert torch.equal(got, _bytes(getattr(searched, name))), name
        assert not torch.equal(got, _bytes(getattr(plain, name))), name
    assert torch.equal(ref.preprocess(q, k, v).q_scales.view(torch.uint8), plain.q_scales.view(torch.uint8))


def test_other_knobs_set_on_the_package_change_their_readers(monkeypatch):
    """MEAN_SAMPLE_BLOCKS (``sample_blocks``), AUTO_QUERY_STRIDE (``qk_fp4_error``) and
    AUTO_ERROR_LIMIT (``choose_qk_precision``) are read per call from the package."""
    assert ref.sample_blocks(2048) == [0, 2, 4, 6, 8, 10, 12, 14]
    monkeypatch.setattr(ref, "MEAN_SAMPLE_BLOCKS", 2)
    assert ref.sample_blocks(2048) == [0, 8]
    monkeypatch.undo()

    q, k, v = ac.make("q_outliers", 1, 2, 1, 512, 512, 64, seed=5)
    pre = ref.preprocess(q, k, v)
    err = ref.qk_fp4_error(q, k, v, pre)
    monkeypatch.setattr(ref, "AUTO_QUERY_STRIDE", 3)
    assert not torch.equal(ref.qk_fp4_error(q, k, v, pre), err)
    monkeypatch.undo()
    assert torch.equal(ref.qk_fp4_error(q, k, v, pre), err)

    assert torch.equal(ref.choose_qk_precision("auto", err), err > 0.2)
    above = float(err.max()) * 2
    monkeypatch.setattr(ref, "AUTO_ERROR_LIMIT", above)
    assert not ref.choose_qk_precision("auto", err).any()
    monkeypatch.setattr(ref, "AUTO_ERROR_LIMIT", 0.0)
    assert ref.choose_qk_precision("auto", err).all()


@pytest.mark.parametrize("knob", KNOBS)
def test_knobs_live_on_the_package_only(knob):
    """No submodule holds a copy of a knob (a copy would not see the package's value)."""
    assert hasattr(ref, knob)
    assert [m.__name__ for m in SUBMODULES if knob in vars(m)] == []
