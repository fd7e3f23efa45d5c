import math, sys, torch
sys.path.insert(0, "tests")
from test_fa4_varlen_paged import _packed, _cu
from flash_attn.cute import flash_attn_varlen_func as fa4
from fa4_rowmax import interface
interface.FEATURES_TESTED_16BIT = interface.SERVING_LAYOUT_FEATURES
lengths = (130, 70, 200)
q = _packed(9, lengths, 4, 128, torch.bfloat16)
k, v = (_packed(10 + i, lengths, 4, 128, torch.bfloat16) for i in (0, 1))
v[130 + 69, 0, 3] = math.nan
for mode in ("exact", "rowmax_h15"):
    out = fa4(q, k, v, cu_seqlens_q=_cu(lengths), cu_seqlens_k=_cu(lengths), softmax_mode=mode)
    out = out[0] if isinstance(out, tuple) else out
    nan_rows = torch.isnan(out).any(-1).any(-1).nonzero().flatten().tolist()
    print(mode, "rows with NaN:", len(nan_rows), nan_rows[:3], "...", nan_rows[-3:], "heads:", torch.isnan(out).any(0).any(-1).tolist())
