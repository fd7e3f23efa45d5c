"""The vLLM attention backend `FA4_ROWMAX` (CUDA): vLLM's FLASH_ATTN backend with its prefill attention served by
the patched FA4 (`flash_attn.cute.flash_attn_varlen_func` with the backend's softmax setting, `rowmax_h15` by
default); decode and every other path run vLLM's stock implementation.

vLLM imports this module only when the user selects the backend (`--attention-backend CUSTOM`, the slot
`fa4_rowmax.vllm_plugin` binds; Note [FA4_ROWMAX: opt-in by selection]), on a CUDA build of vLLM: the parent
classes import vLLM's CUDA stack. vLLM bundles its own FlashAttention (`vllm.vllm_flash_attn`), so this backend is
the only way vLLM's calls reach the patched external FA4. What goes where: Note [Which vLLM paths reach FA4] in
fa4_rowmax/vllm_routing.py. Written against vLLM 0.33.0's `vllm.v1.attention.backends.flash_attn`; what a run on
vLLM 0.26.0 (the release that pins the H200's torch 2.11) would need: docs/vllm_fa4_rowmax.md.
"""

import logging
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from flash_attn.cute import flash_attn_varlen_func
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from fa4_rowmax import vllm_routing
from fa4_rowmax.interface import is_fa4_patched
from fa4_rowmax.vllm_plugin import BACKEND_NAME, VLLM_SLOT, softmax_setting

logger = logging.getLogger(__name__)


@dataclass
class FA4RowmaxMetadata(FlashAttentionMetadata):
    split: vllm_routing.BatchSplit | None = None  # None: a metadata built outside this backend's builder


class FA4RowmaxMetadataBuilder(FlashAttentionMetadataBuilder):
    """FLASH_ATTN's builder, asking vLLM for decodes first and recording the decode/prefill split."""

    reorder_batch_threshold: int = vllm_routing.DECODE_QUERY_LEN

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A speculator's draft-decode graph refreshes metadata on the device only; the split is a host decision.
        self.supports_draft_decode_metadata_update = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE  # Note [Which vLLM paths reach FA4]

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> FA4RowmaxMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        split = vllm_routing.split_batch(common_attn_metadata.query_start_loc_cpu, common_attn_metadata.num_reqs)
        return FA4RowmaxMetadata(**{f.name: getattr(metadata, f.name) for f in fields(metadata)}, split=split)


class FA4RowmaxImpl(FlashAttentionImpl):
    """FLASH_ATTN's implementation with the plain decoder path's prefills sent to the patched FA4."""

    supports_dcp: bool = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not is_fa4_patched():
            raise RuntimeError(
                f"attention backend {BACKEND_NAME} needs the patched FlashAttention-4: run "
                "`python -m fa4_rowmax.patching apply`"
            )
        self.softmax_setting = softmax_setting()
        vllm_config = get_current_vllm_config_or_none()
        model_config = vllm_config.model_config if vllm_config is not None else None
        # vLLM builds the model's layers under its dtype as torch's default.
        dtype = model_config.dtype if model_config is not None else torch.get_default_dtype()
        major, minor = torch.cuda.get_device_capability()
        self.stock_reason = vllm_routing.layer_stock_reason(
            self.softmax_setting,
            arch=10 * major + minor,
            dtype=dtype,
            alibi_slopes=self.alibi_slopes,
            logits_soft_cap=self.logits_soft_cap,
            sliding_window=self.sliding_window,
            sinks=self.sinks,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if self.stock_reason is None:
            logger.info(
                "fa4_rowmax: %s: prefill attention through the patched FA4 (%s)", BACKEND_NAME, self.softmax_setting
            )
        else:
            logger.warning("fa4_rowmax: %s: this layer runs stock FLASH_ATTN: %s", BACKEND_NAME, self.stock_reason)

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        split = getattr(attn_metadata, "split", None)
        if (
            self.stock_reason is not None
            or split is None
            or split.num_prefills == 0
            or attn_metadata.causal is not True
            or output_scale is not None
            or output_block_scale is not None
        ):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        decode_end, end = split.num_decode_tokens, attn_metadata.num_actual_tokens
        if split.num_decodes:
            super().forward(
                layer,
                query[:decode_end],
                key[:decode_end],
                value[:decode_end],
                kv_cache,
                vllm_routing.decode_metadata(attn_metadata, split),
                output[:decode_end],
            )
        key_cache, value_cache = vllm_routing.paged_kv(kv_cache, self.head_size)
        with torch.no_grad():  # the approximate modes are forward-only (FA4's backward recomputes P exactly)
            out, _ = flash_attn_varlen_func(
                query[decode_end:end],
                key_cache,
                value_cache,
                softmax_scale=self.scale,
                causal=True,
                **vllm_routing.prefill_arguments(attn_metadata, split),
                **self.softmax_setting.fa4_arguments(),
            )
        output[decode_end:end].copy_(out)
        return output


class FA4RowmaxBackend(FlashAttentionBackend):
    """Declares only what FA4_ROWMAX serves (Note [Which vLLM paths reach FA4]), so vLLM's
    `validate_configuration` refuses the rest."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(vllm_routing.SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(vllm_routing.SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return VLLM_SLOT  # vLLM's attention layer looks the backend up by this name

    @staticmethod
    def get_impl_cls() -> type[FA4RowmaxImpl]:
        return FA4RowmaxImpl

    @staticmethod
    def get_builder_cls() -> type[FA4RowmaxMetadataBuilder]:
        return FA4RowmaxMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(vllm_routing.SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in vllm_routing.SUPPORTED_HEAD_SIZES  # FLASH_ATTN's override ignores the list

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major in vllm_routing.SUPPORTED_CAPABILITY_MAJORS

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the split is planned from the host-side query lengths
