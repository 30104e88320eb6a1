"""A Hugging Face transformers `Cache` whose layers are openkernels `KVCache`s (16-bit, int8 or int4).

    cache = OpenKernelsCache(model.config, batch_size, max_seqlen, kv_dtype="int4")
    model.generate(input_ids, cache=cache, max_new_tokens=...)   # attn_implementation="openkernels"

Each decoder layer gets one `OpenKernelsCacheLayer` (transformers' `CacheLayerMixin` API)
holding a contiguous `KVCache` of `batch_size` sequences of up to `max_seqlen` tokens. Its
`update` appends the new keys and values (quantized on append for int8/int4) and returns, in
place of the key and value tensors, a `CachedKV` handle: the layer's `KVCache` and the number
of tokens just appended. `hf_attention_forward` (hf.py) recognizes the handle and runs
`KVCache.attend`, the fused attention against the cache; nothing is dequantized to a full
tensor. So the cache needs `attn_implementation="openkernels"` (`register_with_transformers()`).

transformers is imported only when one of the Cache classes (`OpenKernelsCache`,
`OpenKernelsStaticCache` and their layers) is first looked up (this module's `__getattr__`), so
the package imports without it.

Limits: masks may hide a left padding and nothing else (a left-padded batch in generate():
`hf_attention_forward` turns the mask into attention_with_kvcache's cache_leftpad, with one
device-to-host read per call; any other hidden token raises NotImplementedError); the batch size is
fixed at construction (beam search reorders it in place; `batch_repeat_interleave` /
`batch_select_indices` raise); inference only; not `torch.compile`-able (`is_compileable` is
False, so `generate` does not compile it; see `OpenKernelsStaticCache`); full- and sliding-window attention layers only
(a sliding layer keeps every token and lets the kernel apply the window).

`OpenKernelsStaticCache` is the compileable variant (for `torch.compile`, CUDA graphs and
`generate`'s automatic compile of the decode step): one `OpenKernelsStaticLayer` per decoder
layer preallocates its storage (attention_with_kvcache's (batch, max_seqlen, heads_kv,
head_dim) layout: tensors, or `QuantizedKV` for int8/int4) and keeps its length in a device
int32 tensor, so nothing in a step reads a value on the host. Its `update` writes nothing:
it returns a `StaticCachedKV` handle (the layer, the new keys and values, and the length
before them) and advances the length tensor in place; `hf_attention_forward` then appends
and attends in one `attention_with_kvcache` call. transformers builds a (batch, 1, new,
max_seqlen) causal mask for a static cache; eager calls check that it hides nothing beyond
causality, the window and a left padding (any other mask raises), compiled ones cannot check it
and take the left padding from it on the device (see hf.py). While compiling, the capacity is not checked
either (`max_seqlen` must hold the prompt plus every generated token, as generate() sizes it).
"""

from __future__ import annotations

from typing import Any

import torch

from openkernels.shared.platform import graph_capturing

from .cache import KVCache
from .format import QuantizedKV

__all__ = [  # noqa: F822 (the Cache classes: __getattr__)
    "CachedKV",
    "StaticCachedKV",
    "OpenKernelsCache",
    "OpenKernelsCacheLayer",
    "OpenKernelsStaticCache",
    "OpenKernelsStaticLayer",
]

_LAZY = ("OpenKernelsCache", "OpenKernelsCacheLayer", "OpenKernelsStaticCache", "OpenKernelsStaticLayer")
_KV_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32, "int8", "int4", "fp8")


class CachedKV:
    """What `OpenKernelsCacheLayer.update` returns in place of key/value tensors: the layer's
    `KVCache`, the new tokens already appended, and how many tokens were appended. Only
    `hf_attention_forward` reads it; anything that treats it as a tensor gets an error that says so."""

    __slots__ = ("cache", "new_tokens")

    def __init__(self, cache: KVCache, new_tokens: int) -> None:
        self.cache = cache
        self.new_tokens = new_tokens

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # protocols (copy, pickle, ...) probe for these
            raise AttributeError(name)
        raise AttributeError(
            f"CachedKV has no attribute {name!r}: OpenKernelsCache returns handles to openkernels' KV cache instead of "
            "key/value tensors, and only openkernels' attention reads them. Call "
            "openkernels.attention.register_with_transformers() and use attn_implementation='openkernels'."
        )

    def __repr__(self) -> str:
        return f"CachedKV(new_tokens={self.new_tokens}, cache={self.cache!r})"


class StaticCachedKV:
    """What `OpenKernelsStaticLayer.update` returns in place of key/value tensors: the layer (its
    preallocated `k_cache` / `v_cache`), the new keys and values (batch, heads_kv, new, head_dim),
    not yet written, and `cache_seqlens`, the layer's length before them as a (batch,) int32
    tensor (batch 1: a view of the layer's length). `hf_attention_forward` appends and attends
    with them in one attention_with_kvcache call, then advances the layer's length; anything
    that treats the handle as a tensor gets an error that says so. `rotary`: None, or the
    per-token (cos, sin) of transformers' position embeddings when the caller left q and
    k_new unrotated for the attention to rotate (kernelize's attention forward does, so that
    a decode step rotates, appends and attends in one kernel)."""

    __slots__ = ("cache_seqlens", "k_new", "layer", "rotary", "v_new")

    def __init__(
        self, layer: Any, k_new: torch.Tensor, v_new: torch.Tensor, cache_seqlens: torch.Tensor
    ) -> None:
        self.layer = layer
        self.k_new = k_new
        self.v_new = v_new
        self.cache_seqlens = cache_seqlens
        self.rotary: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"StaticCachedKV has no attribute {name!r}: OpenKernelsStaticCache returns handles to openkernels' KV cache "
            "instead of key/value tensors, and only openkernels' attention reads them. Call "
            "openkernels.attention.register_with_transformers() and use attn_implementation='openkernels'."
        )

    def __repr__(self) -> str:
        return f"StaticCachedKV(new_tokens={self.k_new.shape[-2]}, layer={self.layer!r})"


def __getattr__(name: str) -> Any:
    """Build the transformers subclasses on first use (transformers imported then)."""
    if name in _LAZY:
        classes = _build_classes()
        globals().update(classes)
        return classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def _build_classes() -> dict[str, type]:
    try:
        from transformers.cache_utils import Cache, CacheLayerMixin
    except ImportError as e:  # the names still resolve (star imports); using them says what is missing
        message = f"OpenKernelsCache needs Hugging Face transformers (pip install transformers): {e}"

        class _Missing:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError(message)

        return {name: type(name, (_Missing,), {"__module__": __name__}) for name in _LAZY}

    class _Layer(CacheLayerMixin):
        """What both layer kinds share: their arguments, the fixed batch, no offloading."""

        cache_name = ""  # for messages
        is_croppable = True

        def __init__(
            self,
            batch_size: int,
            max_seqlen: int,
            *,
            kv_dtype: torch.dtype | str | None = None,
            group_size: int | None = None,
            device: torch.device | str | None = None,
            sliding_window: int | None = None,
            key_group: int | None = None,
        ) -> None:
            super().__init__()
            self.batch_size = batch_size
            self.max_seqlen = max_seqlen
            self.kv_dtype = kv_dtype
            self.group_size = group_size
            self.key_group = key_group
            self.device = None if device is None else torch.device(device)
            self.is_sliding = sliding_window is not None
            self.sliding_window = sliding_window

        def _storage_format(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
            """(heads_kv, head_dim, kv_dtype, device) of the storage, from the first keys and values."""
            _, heads_kv, _, head_dim = key_states.shape
            if value_states.shape[1] != heads_kv or value_states.shape[-1] != head_dim:
                raise ValueError(f"{self.cache_name}: keys {tuple(key_states.shape)} and values "
                                 f"{tuple(value_states.shape)} must share heads and head_dim")  # fmt: skip
            kv_dtype = key_states.dtype if self.kv_dtype is None else self.kv_dtype
            if isinstance(kv_dtype, torch.dtype) and kv_dtype != key_states.dtype:
                raise TypeError(f"{self.cache_name}: a 16-bit cache holds the model's dtype ({key_states.dtype}), "
                                f"got kv_dtype={kv_dtype}; pass kv_dtype=None, 'int8', 'int4' or 'fp8'")  # fmt: skip
            return heads_kv, head_dim, kv_dtype, key_states.device if self.device is None else self.device

        def get_max_length(self) -> int:
            return self.max_seqlen

        def get_max_cache_shape(self) -> int:  # the name of transformers before 5
            return self.max_seqlen

        def _check_crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"{self.cache_name}: crop takes a negative number of tokens to remove, got "
                                 f"{tokens_to_remove}")  # fmt: skip

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise NotImplementedError(f"{self.cache_name}: the batch size is fixed at construction; build the "
                                      "cache for the expanded batch")  # fmt: skip

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            raise NotImplementedError(f"{self.cache_name}: the batch size is fixed at construction")

        def offload(self) -> None:
            raise NotImplementedError(f"{self.cache_name}: offloading is not supported")

        prefetch = offload

    class _Cache(Cache):
        """What both cache kinds share: one layer of `layer_class` per decoder layer."""

        layer_class: type = _Layer

        def __init__(
            self,
            config: Any,
            batch_size: int,
            max_seqlen: int,
            *,
            kv_dtype: torch.dtype | str | None = None,
            group_size: int | None = None,
            device: torch.device | str | None = None,
            key_group: int | None = None,
        ) -> None:
            layers = _make_layers(type(self).__name__, self.layer_class, config, batch_size, max_seqlen, kv_dtype,
                                  group_size, device, key_group)  # fmt: skip
            super().__init__(layers=layers)
            self.max_seqlen = max_seqlen
            self.kv_dtype = kv_dtype

        def get_max_cache_shape(self, layer_idx: int = 0) -> int:  # the name of transformers before 5
            return self.max_seqlen

    class OpenKernelsCacheLayer(_Layer):
        """One decoder layer's cache: a contiguous openkernels `KVCache`, allocated on the first
        `update` (heads_kv, head_dim and the device come from the first keys)."""

        cache_name = "OpenKernelsCache"
        is_compileable = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.kv: KVCache | None = None

        def __repr__(self) -> str:
            return f"{type(self).__name__}({self.kv!r})"

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            heads_kv, head_dim, kv_dtype, device = self._storage_format(key_states, value_states)
            self.kv = KVCache(self.batch_size, self.max_seqlen, heads_kv, head_dim, kv_dtype=kv_dtype,
                              group_size=self.group_size, device=device, key_group=self.key_group)  # fmt: skip
            self.device = device
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[CachedKV, CachedKV]:
            """Append keys/values (batch, heads_kv, new, head_dim) and return the layer's handle
            twice (where transformers expects the keys and the values)."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if key_states.shape[0] != self.batch_size:
                raise ValueError(f"OpenKernelsCache: the cache was built for batch_size={self.batch_size}, got a batch "
                                 f"of {key_states.shape[0]}")  # fmt: skip
            if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
                raise RuntimeError("OpenKernelsCache is for inference: run under torch.no_grad()")
            self.kv.append(key_states.transpose(1, 2), value_states.transpose(1, 2))
            handle = CachedKV(self.kv, key_states.shape[-2])
            return handle, handle

        def get_seq_length(self) -> int:
            return 0 if self.kv is None else max(self.kv.lengths, default=0)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            """(kv_length, kv_offset) of the mask transformers builds: every cached token plus the new ones."""
            return self.get_seq_length() + query_length, 0

        def reset(self) -> None:
            """Forget every token; the storage is kept."""
            if self.kv is not None:
                self.kv.reset()

        def crop(self, tokens_to_remove: int) -> None:
            """Drop the last -tokens_to_remove tokens (a negative int, as transformers' layers take it)."""
            self._check_crop(tokens_to_remove)
            if tokens_to_remove == 0 or self.kv is None:
                return
            length = max(self.get_seq_length() + tokens_to_remove, 0)
            self.kv.seqlens.fill_(length)
            self.kv._lengths = [length] * self.batch_size  # the KVCache's host copy of seqlens

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            """Beam search: sequence b takes sequence beam_idx[b]'s tokens (rows copied in place)."""
            if self.kv is None or self.get_seq_length() == 0:
                return
            idx = beam_idx.to(self.kv.seqlens.device)
            for side in (self.kv.k, self.kv.v):
                parts = (side,) if isinstance(side, torch.Tensor) else (side.data, side.scale, side.zero)
                for t in parts:
                    t.copy_(t.index_select(0, idx))
            lengths = self.kv.lengths
            self.kv.seqlens.copy_(self.kv.seqlens.index_select(0, idx))
            self.kv._lengths = [lengths[i] for i in idx.tolist()]

    class OpenKernelsCache(_Cache):
        """transformers `Cache` backed by openkernels' `KVCache`, one per decoder layer.

        config: the model's config (its decoder's layer types: full or sliding-window attention).
        batch_size: sequences decoded together (fixed; the batch generate() runs, beams included).
        max_seqlen: tokens per sequence, prompt plus generated (storage is allocated for all of
            them on the first forward).
        kv_dtype: None (the model's dtype, stored as is), "int8" or "int4" (codes with a float16
            scale and zero per token, head and group of `group_size` elements; see format.py),
            or "fp8" (float8_e4m3fn with the uncalibrated per-head scale 1.0: values beyond 448
            saturate; for calibrated scales build the layers' `KVCache`s yourself).
        group_size: 32, 64, 128 or None (the whole head), for int8/int4.
        key_group: int8/int4: None (keys per token), or 32 / 64 for keys quantized by channel over
            groups of that many tokens (KIVI; see KVCache); not with left-padded batches, and
            not in OpenKernelsStaticCache.
        device: where the storage lives (default: the keys' device).
        Needs attn_implementation="openkernels" (`register_with_transformers()`); see kvcache/hf.py
        for the limits.
        """

        layer_class = OpenKernelsCacheLayer

        @property
        def nbytes(self) -> int:
            """Bytes of K/V storage allocated so far."""
            return sum(layer.kv.nbytes for layer in self.layers if layer.kv is not None)

    class OpenKernelsStaticLayer(_Layer):
        """One decoder layer's compileable cache: `k_cache` / `v_cache` preallocated in
        attention_with_kvcache's (batch, max_seqlen, heads_kv, head_dim) layout (tensors, or
        `QuantizedKV` for int8/int4/fp8, allocated as `KVCache` allocates them) on the first `update`,
        and `cumulative_length`, a device int32 0-d tensor: the tokens every sequence holds. The
        storage and the length keep their addresses (torch._dynamo.mark_static_address), and every
        change to them is in place, so CUDA graphs can replay a compiled or captured decode step."""

        cache_name = "OpenKernelsStaticCache"
        is_compileable = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.k_cache: torch.Tensor | QuantizedKV | None = None
            self.v_cache: torch.Tensor | QuantizedKV | None = None
            # A tensor, so that its value changing is no recompile (transformers' static layers do the same).
            self.cumulative_length = torch.zeros((), dtype=torch.int32, device=self.device)
            # Its value counted on the host while only eager calls change it: an eager decode step
            # then reads no length from the device (a read per layer stalls the host until the GPU
            # has caught up). A compiled or captured call advances the length without running
            # Python, so the first one turns the counting off for good (_host_counts) and every
            # later eager call reads the length once.
            self._host_length: int | None = 0
            self._host_counts = True
            self.plans: dict = {}  # call signature -> checked KVCallPlan (eager calls; see hf._attend_static)

        def __repr__(self) -> str:
            fmt = self.kv_dtype if self.kv_dtype is not None else "model dtype"
            return (f"{type(self).__name__}(batch_size={self.batch_size}, max_seqlen={self.max_seqlen}, "
                    f"kv_dtype={fmt}, initialized={self.is_initialized})")  # fmt: skip

        def _storage(self) -> list[torch.Tensor]:
            parts = []
            for side in (self.k_cache, self.v_cache):
                parts += (
                    [side.data, side.scale, side.zero, side.residual]
                    if isinstance(side, QuantizedKV)
                    else [side]
                )
            return [t for t in parts if t is not None]

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            heads_kv, head_dim, kv_dtype, device = self._storage_format(key_states, value_states)
            # KVCache checks head_dim and group_size and allocates the storage; its tensors are kept.
            kv = KVCache(self.batch_size, self.max_seqlen, heads_kv, head_dim, kv_dtype=kv_dtype,
                         group_size=self.group_size, device=device, key_group=self.key_group)  # fmt: skip
            self.k_cache, self.v_cache = kv.k, kv.v
            self.heads_kv, self.head_dim = heads_kv, head_dim
            self.cumulative_length = self.cumulative_length.to(device)
            self.device = device
            # Fixed addresses: no recompiles, and CUDA graphs may mutate them in place. Not possible
            # while tracing (a compiled prefill; generate() runs the prefill eagerly).
            if not torch.compiler.is_compiling():
                for t in (*self._storage(), self.cumulative_length):
                    torch._dynamo.mark_static_address(t)
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[StaticCachedKV, StaticCachedKV]:
            """Return the handle (twice, where transformers expects the keys and the values) of keys
            and values (batch, heads_kv, new, head_dim) to append. Nothing is written here: the
            attention appends them in the same kernel call and then advances the length by `new`."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if key_states.shape[0] != self.batch_size:
                raise ValueError(f"OpenKernelsStaticCache: the cache was built for batch_size={self.batch_size}, got a "
                                 f"batch of {key_states.shape[0]}")  # fmt: skip
            if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
                raise RuntimeError("OpenKernelsStaticCache is for inference: run under torch.no_grad()")
            new = key_states.shape[-2]
            if torch.compiler.is_compiling() or graph_capturing(key_states.device):
                self._host_counts, self._host_length = False, None
            else:
                held = self._host_length
                if held is None:  # one small device-to-host read, before any change
                    held = int(self.cumulative_length)
                    if self._host_counts:
                        self._host_length = held
                if held + new > self.max_seqlen:
                    raise ValueError(f"OpenKernelsStaticCache: {held} cached tokens plus {new} new ones are outside "
                                     f"the cache's capacity of {self.max_seqlen} tokens")  # fmt: skip
            # The lengths before the new tokens; the attention advances the length after its call
            # (a call that fails leaves it as it was). One sequence: the length itself, a (1,)
            # view (one launch fewer per layer and step); several: a (batch,) copy.
            held = self.cumulative_length
            cache_seqlens = held.expand(1) if self.batch_size == 1 else held.expand(self.batch_size).clone()
            handle = StaticCachedKV(self, key_states, value_states, cache_seqlens)
            return handle, handle

        def host_lengths_after(self, new: int) -> list[int] | None:
            """Every sequence's length after `new` more tokens when the host counts it (eager
            calls only so far), else None (the caller reads or trusts the device)."""
            if self._host_length is None:
                return None
            return [self._host_length + new] * self.batch_size

        def advance(self, new: int, on_device: bool = True) -> None:
            """The length plus `new` (in place on the device; counted on the host as well).
            on_device=False: the attention call advanced the device length itself (the fused
            append): only the host count moves."""
            if on_device:
                self.cumulative_length.add_(new)
            if self._host_length is not None:
                self._host_length += new

        def get_seq_length(self) -> torch.Tensor | int:
            """The tokens held, as the device 0-d tensor (as transformers' static layers: reading it
            on the host is the caller's choice), or 0 before the first update."""
            return self.cumulative_length if self.is_initialized else 0

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            """(kv_length, kv_offset) of the mask transformers builds: the whole static capacity."""
            return self.max_seqlen, 0

        def reset(self) -> None:
            """Forget every token (the length set to 0 in place); the storage is kept."""
            self.cumulative_length.zero_()
            if self._host_counts:
                self._host_length = 0

        def crop(self, tokens_to_remove: int) -> None:
            """Drop the last -tokens_to_remove tokens (a negative int, as transformers' layers take
            it; the length stops at 0). In place: the next update writes over them."""
            self._check_crop(tokens_to_remove)
            if tokens_to_remove == 0 or not self.is_initialized:
                return
            self.cumulative_length.sub_(-tokens_to_remove).clamp_(min=0)
            if self._host_length is not None:
                self._host_length = max(0, self._host_length + tokens_to_remove)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            """Beam search: sequence b takes sequence beam_idx[b]'s tokens (rows copied in place)."""
            if not self.is_initialized:
                return
            idx = beam_idx.to(self.cumulative_length.device)
            for t in self._storage():
                t.copy_(t.index_select(0, idx))

    class OpenKernelsStaticCache(_Cache):
        """Compileable transformers `Cache` backed by openkernels' KV cache formats, for
        torch.compile / CUDA graphs (generate() compiles the decode step by itself on CUDA for a
        compileable cache): one `OpenKernelsStaticLayer` per decoder layer.

        Arguments as `OpenKernelsCache`'s: config, batch_size, max_seqlen (the prompt plus every
        generated token; not checked while compiling), kv_dtype (None, "int8", "int4", "fp8"),
        group_size, device. Needs attn_implementation="openkernels"; left padding only (see kvcache/hf.py).
        """

        layer_class = OpenKernelsStaticLayer

        @property
        def nbytes(self) -> int:
            """Bytes of K/V storage allocated so far."""
            return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                       for t in layer._storage())  # fmt: skip

    classes = {
        "OpenKernelsCache": OpenKernelsCache,
        "OpenKernelsCacheLayer": OpenKernelsCacheLayer,
        "OpenKernelsStaticCache": OpenKernelsStaticCache,
        "OpenKernelsStaticLayer": OpenKernelsStaticLayer,
    }
    for cls in classes.values():
        cls.__module__ = __name__
    return classes


def _make_layers(name: str, layer_cls: type, config: Any, batch_size: Any, max_seqlen: Any, kv_dtype: Any,
                 group_size: Any, device: Any, key_group: Any = None) -> list:  # fmt: skip
    """One `layer_cls` per decoder layer of `config`, the arguments checked."""
    if kv_dtype not in _KV_DTYPES:
        raise ValueError(
            f"{name}: kv_dtype must be None, a float dtype, 'int8', 'int4' or 'fp8', got {kv_dtype!r}"
        )
    if key_group is not None and layer_cls.is_compileable:
        raise ValueError(f"{name}: key_group (keys by channel) is not supported by the compileable cache: it "
                         "passes every batch's left padding on, which keys by channel do not take; use "
                         "OpenKernelsCache")  # fmt: skip
    for what, n in (("batch_size", batch_size), ("max_seqlen", max_seqlen)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}: {what} must be a positive int, got {n!r}")
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = []
    for i, (layer_type, sliding_window) in enumerate(_layer_types(text_config)):
        if layer_type not in ("full_attention", "sliding_attention"):
            raise NotImplementedError(f"{name}: layer {i} is {layer_type!r}; only full and sliding-window attention "
                                      "layers are supported")  # fmt: skip
        layers.append(layer_cls(batch_size, max_seqlen, kv_dtype=kv_dtype, group_size=group_size, device=device,
                                sliding_window=sliding_window, key_group=key_group))  # fmt: skip
    return layers


def _layer_types(config: Any) -> list[tuple[str, int | None]]:
    """(layer type, sliding window or None) per decoder layer, as transformers' caches read them:
    from `get_layer_types_and_kwargs` where it gives one kwargs dict per layer (5.2x), else from
    the config's fields (earlier versions; 5.17's function returns no per-layer kwargs, which
    zipped into zero layers and an IndexError at the first decode step)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(config)
    except (ImportError, AttributeError):
        types, kwargs = None, None
    if types and isinstance(kwargs, (list, tuple)) and len(kwargs) == len(types):
        return [(t, kw.get("sliding_window")) for t, kw in zip(types, kwargs)]
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * n
    return [(t, window if t == "sliding_attention" else None) for t in types]
