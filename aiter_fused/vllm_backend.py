"""The vLLM attention backend `AITER_FUSED`: vLLM's ROCM_AITER_FA backend with its prefill and extend
attention served by the Fused-Softmax kernel.

`aiter_fused.vllm_plugin` registers the name with vLLM's backend registry; vLLM imports this module
only when the user selects the backend (`vllm serve ... --attention-backend AITER_FUSED`, or
`attention_config={"backend": "AITER_FUSED"}`), on a ROCm build of vLLM (the parent classes import
AITER's ROCm ops). Written against vLLM 0.33.0's `vllm.v1.attention.backends.rocm_aiter_fa`.

Note [Which vLLM paths reach the fused kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In vLLM 0.33.0, ROCM_AITER_FA's `AiterFlashAttentionImpl.forward` splits a batch into decodes, extends
and prefills. Prefills (new sequences, causal, q and k the same tokens) and extends (a chunked or
prefix-cached prefill: the cached context gathered from the paged KV cache, attended non-causally
with the LSE, then the new suffix causally, the two merged by their LSEs) call
`aiter.flash_attn_varlen_func`, which the AITER override (`aiter_fused.override`) routes to the fused
kernel whenever it serves the call (Note [What the fused path serves] there: a layer with a sliding
window, sinks or ALiBi falls through to AITER). Decodes run AITER's paged-attention kernels and never
reach `flash_attn_varlen_func`: decode attention stays exact. Both ways in end at that one hook:
- this backend: selecting it is the opt-in; its impl installs the override in the worker process;
- the stock ROCM_AITER_FA backend with `AITER_FUSED_ENABLE=1` (`aiter_fused.vllm_plugin`).
This backend declares only what the fused kernel serves (BF16, head dims 64 and 128, no sinks, no
sliding window), so vLLM refuses a model it would otherwise run on AITER's exact kernels.
"""

import logging
from typing import ClassVar

import torch
from vllm.v1.attention.backends.rocm_aiter_fa import AiterFlashAttentionBackend, AiterFlashAttentionImpl

from aiter_fused import override
from aiter_fused.vllm_plugin import BACKEND_NAME

logger = logging.getLogger(__name__)


class AiterFusedImpl(AiterFlashAttentionImpl):
    """ROCM_AITER_FA's implementation; constructing it installs the AITER override in this process."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if override.install():
            logger.info(
                "aiter_fused: attention backend %s selected: prefill/extend attention uses the "
                "Fused-Softmax kernel (%s); decode stays on AITER",
                BACKEND_NAME,
                override.current_format(),
            )
        else:
            logger.warning(
                "aiter_fused: attention backend %s selected but %s=1: it runs as ROCM_AITER_FA",
                BACKEND_NAME,
                override.DISABLE_ENV,
            )


class AiterFusedBackend(AiterFlashAttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = list(override.SUPPORTED_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME  # vLLM looks the backend up by this name in its registry

    @staticmethod
    def get_impl_cls() -> type[AiterFusedImpl]:
        return AiterFusedImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(override.SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False
