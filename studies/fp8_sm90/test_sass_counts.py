"""Every variant the SASS-count study compiles is one the SM90 FP8 forward accepts: resolved on the host
(`fp8_sm90.resolve_stage`, as `flash_attn_fp8_sm90` resolves its arguments), so a knob rule the forward adds
fails here in a second instead of in the study's compile subprocess."""

import pytest

from fa4_rowmax.fp8_sm90 import resolve_stage
from studies.fp8_sm90.sass_counts import VARIANTS


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_variant_resolves_on_the_fp8_forward(name):
    kwargs = VARIANTS[name]
    stage = resolve_stage(rescale_threshold=None, **{"beta": None, **kwargs})
    assert stage.kernel == "sm90_fp8" and stage.mode == kwargs["softmax_mode"]
    for knob, value in kwargs.items():
        if knob not in ("softmax_mode", "beta"):
            assert getattr(stage, knob) == value, knob
