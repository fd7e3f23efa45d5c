"""Shared strategies and checks of the property suites (tests/test_properties*.py): layouts that keep a tensor's
values, seeded inputs, the example budget of Note [Hypothesis profiles] (tests/conftest.py), and the check that an
error names its argument. Not a test module: the suites import it, never each other.
"""

import math
import re

import torch
from hypothesis import settings
from hypothesis import strategies as st

# Note [Hypothesis profiles]: how many times the "deep" profile multiplies each test's budget.
DEEP_EXAMPLES_FACTOR = 20


def examples(n: int) -> settings:
    """`@examples(n)`: n examples under the default ("ci") profile, DEEP_EXAMPLES_FACTOR times n under "deep";
    every other setting is the loaded profile's."""
    deep = settings.get_current_profile_name() == "deep"
    return settings(max_examples=n * DEEP_EXAMPLES_FACTOR if deep else n)


# Note [Layouts]: each layout holds the same values as the contiguous tensor, so no entry may answer differently.
# "transposed" permutes the last two strides (dense: `torch.empty_like` copies such strides), "gapped" reads every
# other element of a wider buffer (last-dim stride 2), "offset" starts 16 elements into its storage (aligned for
# every dtype's 16-byte rule), "heads_major" stores heads before tokens (last dim contiguous, tokens strided),
# "clone" is a dtype-preserving copy.
LAYOUTS = ("contiguous", "transposed", "gapped", "offset", "heads_major", "clone")


def relayout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """`x`'s values in `layout` (Note [Layouts])."""
    if layout == "contiguous":
        y = x.contiguous()
    elif layout == "transposed":
        y = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "gapped":
        y = x.new_empty(*x.shape[:-1], 2 * x.shape[-1])[..., ::2]
        y.copy_(x)
    elif layout == "offset":
        y = x.new_empty(x.numel() + 16)[16:].view(x.shape)
        y.copy_(x)
    elif layout == "heads_major":
        order = (0, 2, 1, 3) if x.dim() == 4 else (1, 0, 2)
        y = x.permute(order).contiguous().permute(order)
    elif layout == "clone":
        y = x.clone()
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if not same_values(y, x):
        raise AssertionError(f"relayout({layout!r}) changed the values")
    return y


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal values (NaNs in the same places count as equal), same shape and dtype; any layout."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b)) or bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))


def assert_same_results(got, want) -> None:
    """Every tensor of `got` bit-equal to `want`'s (values, shape, dtype)."""
    got, want = (r if isinstance(r, tuple) else (r,) for r in (got, want))
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor):
            assert same_values(g, w), f"result {index}: max |diff| {(g.double() - w.double()).abs().max()}"
        else:
            assert g == w, f"result {index}: {g!r} != {w!r}"


def seeded(shape, seed: int, dtype=torch.float32, scale: float = 1.0, device="cpu") -> torch.Tensor:
    """N(0, scale^2) values of `shape` from `seed` (hypothesis draws the seed, torch draws the values: fast, and
    the example shrinks through the seed and the scale)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype).to(device)


seeds = st.integers(min_value=0, max_value=2**31 - 1)


@st.composite
def attention_shapes(draw, *, head_dims=(64,), max_seqlen=24, max_batch=2, max_heads_k=2, max_group=2):
    """(batch, seqlen_q, seqlen_k, heads_k, group, head_dim), every size at least 1."""
    return dict(
        batch=draw(st.integers(1, max_batch)),
        seqlen_q=draw(st.integers(1, max_seqlen)),
        seqlen_k=draw(st.integers(1, max_seqlen)),
        heads_k=draw(st.integers(1, max_heads_k)),
        group=draw(st.integers(1, max_group)),
        head_dim=draw(st.sampled_from(head_dims)),
    )


@st.composite
def varlen_lengths(draw, *, max_batch=3, max_seqlen=16, min_seqlen=0):
    """Per-sequence (seqlen_q, seqlen_k) lists; empty sequences included."""
    batch = draw(st.integers(1, max_batch))
    lengths = st.integers(min_seqlen, max_seqlen)
    return draw(st.lists(lengths, min_size=batch, max_size=batch)), draw(
        st.lists(lengths, min_size=batch, max_size=batch)
    )


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def dense_inputs(shape: dict, seed: int, dtype=torch.float32, scale: float = 1.0, device="cpu"):
    batch, heads_k, head_dim = shape["batch"], shape["heads_k"], shape["head_dim"]
    heads_q = heads_k * shape["group"]
    q = seeded((batch, shape["seqlen_q"], heads_q, head_dim), seed, dtype, scale, device)
    k = seeded((batch, shape["seqlen_k"], heads_k, head_dim), seed + 1, dtype, scale, device)
    v = seeded((batch, shape["seqlen_k"], heads_k, head_dim), seed + 2, dtype, 1.0, device)
    return q, k, v


def names_argument(error: BaseException, *names: str) -> bool:
    """Whether `error`'s message names one of `names` as a word (`q` in "q must ...", not in "requires")."""
    message = str(error)
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) for name in names)


def assert_refused_naming(call, names, errors=(TypeError, ValueError)) -> BaseException:
    """`call()` raises one of `errors` whose message names one of `names`; returns the error."""
    try:
        call()
    except errors as error:
        assert names_argument(error, *names), f"{type(error).__name__} does not name any of {names}: {error}"
        return error
    raise AssertionError(f"accepted; expected a {' or '.join(e.__name__ for e in errors)} naming one of {names}")


# Bad values for the common argument kinds (each a (label, value) pair, so a failure says which).
NOT_A_BOOL = [("int 1", 1), ("str", "yes"), ("None", None), ("float", 1.0)]
BAD_POSITIVE_REALS = [
    ("nan", math.nan),
    ("inf", math.inf),
    ("-inf", -math.inf),
    ("negative", -1.0),
    ("zero", 0.0),
    ("str", "0.1"),
    ("bool", True),
    ("huge int", 10**400),
    ("complex", 1j),
]


# Values a caller might pass where a real number is wanted: reals of every size and sign (NaN, infinities, ints
# past float's range), and the look-alikes a check must refuse (bools, strings, complex, None).
real_like_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**400), 10**400),
    st.sampled_from((0, 1, 127, 10**400, -0.0, 1e-300)),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.complex_numbers(max_magnitude=10),
)


def is_real(value) -> bool:
    """A real number and not a bool (bool is an int in Python, never a scale)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def float_or_inf(value) -> float:
    """float(value), inf for an int past float's range."""
    try:
        return float(value)
    except OverflowError:
        return math.inf
