"""A KV cache layer that appends in place: transformers' ``DynamicLayer`` without the copy per step.

Why: ``DynamicLayer.update`` appends a pass's keys and values with ``torch.cat``, a fresh copy of the
whole cached K and V in every layer of every pass.  A one-row pass after S cached positions then
moves 2 * S * layers * heads * head_dim floats that its attention only has to read once; on a CPU
that grows the pass by about a quarter of its own cost per 1,000 positions on the pair's 1.5B
target, and doubles the embedded target's at 2,000 (``benchmarks/bench_kv_buffer.py``).

``spare_layer()`` is ``DynamicLayer`` with spare room: its ``keys`` / ``values`` are prefix views
``buffer[..., :n, :]`` of buffers ``[B, H_kv, capacity, D]``.  An update writes the new positions
into the room after ``n`` and returns the longer views::

    buffer[..., n : n + t, :] = new       # in place: no cached position moves
    keys = buffer[..., : n + t, :]        # the view attention reads (stride capacity * D per head)

The views are made when they are read, not at every append or crop: while the layer holds the
buffers' first ``n`` positions (``_length``), ``keys`` / ``values`` are properties that slice the buffers
to ``n`` on first read, and ``commit(n)`` and a ``crop`` only set ``n``.  A native pass reads the
length (``get_seq_length``) and writes into the buffers (``reserve``), so a one-row step and a round's
roll-back make no tensor at all (60 views a pass on a 30-layer model, two a layer, were ~2 % of a
step on the embedded target).

When the room is short the buffers are reallocated at ``GROWTH`` times the length plus
``MIN_SPARE`` positions, so appends cost amortised O(t).  The values stored and read are the same as
``DynamicLayer``'s; only their place in memory differs.  Everything transformers and draftcert do
to a ``DynamicLayer`` keeps working on the views: a ``crop`` (a shorter view: the next update writes
over the cropped positions), the in-place gather of ``models.tree_attention.keep_cache``, and any
code that assigns ``keys`` / ``values`` a tensor of its own (a batch roll-back's gather, a
``batch_select_indices``): a layer whose ``keys`` is not a prefix view of its buffer copies it into
a new buffer on its next update.  States that carry gradients (a drafter in training) are
appended as ``DynamicLayer`` appends them: autograd needs every pass's tensors unchanged.  A view handed out before a crop sees the positions written after
it: nothing in a pass keeps one (attention reads them within the layer call).
"""

from __future__ import annotations

import torch

__all__ = ["spare_layer", "append_rows", "GROWTH", "MIN_SPARE"]

GROWTH = 1.5  # a reallocated buffer holds this many times the positions it must hold ...
MIN_SPARE = 256  # ... and at least this many more

_CLASS: list[type] = []  # the class, built on first use (transformers is optional: the models extra)


def spare_layer() -> type:
    """The ``DynamicLayer`` subclass that appends in place (module docstring)."""
    if _CLASS:
        return _CLASS[0]
    from transformers.cache_utils import DynamicLayer  # optional: models extra

    class SpareLayer(DynamicLayer):
        """``DynamicLayer`` whose keys and values are prefix views of buffers with spare positions
        (``draftcert.forward.kv_buffer``)."""

        _key_buffer = _value_buffer = None  # [B, H_kv, capacity, D] each
        # n where keys / values are the buffers' first n positions (their views made on read, kept in
        # _keys / _values while current); None: keys / values are the tensors last assigned
        _length: int | None = None
        _keys = _values = None

        def _view(self, name: str):
            """``keys`` (name "_keys") or ``values``: the buffer's first ``_length`` positions (a view made
            once per length), or the tensor assigned."""
            d = self.__dict__
            t, n = d.get(name), d.get("_length")
            if n is not None and (t is None or t.shape[-2] != n):
                buf = d["_key_buffer"] if name == "_keys" else d["_value_buffer"]
                t = d[name] = buf[..., :n, :]
            return t

        def _assign(self, name: str, t) -> None:
            """A tensor of the caller's (``DynamicLayer``'s own code, a roll-back's gather): the other of
            keys / values keeps what it reads now, and ``_length`` is dropped."""
            d = self.__dict__
            if d.get("_length") is not None:
                self._view("_values" if name == "_keys" else "_keys")
                d["_length"] = None
            d[name] = t

        keys = property(lambda self: self._view("_keys"), lambda self, t: self._assign("_keys", t))
        values = property(lambda self: self._view("_values"), lambda self, t: self._assign("_values", t))

        def get_seq_length(self) -> int:
            n = self.__dict__.get("_length")
            return n if n is not None else super().get_seq_length()

        def crop(self, tokens_to_remove: int) -> None:
            n = self.__dict__.get("_length")
            if n is None or tokens_to_remove > 0:  # assigned tensors (or transformers' error): its own crop
                return super().crop(tokens_to_remove)
            self.__dict__["_length"] = max(0, n - abs(tokens_to_remove))  # DynamicLayer's keys[..., :-r, :]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if key_states.requires_grad or value_states.requires_grad:  # training: autograd needs the copies
                return super().update(key_states, value_states, *args, **kwargs)
            kb, vb, n = self.reserve(key_states, value_states)
            t = key_states.shape[-2]
            kb[..., n : n + t, :].copy_(key_states)
            vb[..., n : n + t, :].copy_(value_states)
            self.commit(n + t)
            return self.keys, self.values

        def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor):
            """(key buffer, value buffer, n): buffers whose first n positions hold the layer's keys and
            values and that have room for ``key_states``' ``t`` positions after them (reallocated,
            with the n copied, when they have not).  Nothing is written after n: the caller writes
            positions n .. n + t - 1 of both buffers and calls ``commit(n + t)``."""
            d = self.__dict__
            t = key_states.shape[-2]
            n, kb, vb = d.get("_length"), d.get("_key_buffer"), d.get("_value_buffer")
            if (n is not None and n + t <= kb.shape[-2] and _fits(kb, key_states) and _fits(vb, value_states)):
                return kb, vb, n  # the positions held, room after them: nothing to look at
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys, values = self.keys, self.values
            n = keys.shape[-2] if keys.dim() == 4 else 0
            if not (_prefix_view(keys, kb, key_states) and _prefix_view(values, vb, value_states)
                    and n + t <= kb.shape[-2]):
                cap = n + t + max(MIN_SPARE, int((GROWTH - 1.0) * (n + t)))
                kb, vb = _buffer(key_states, cap), _buffer(value_states, cap)
                if n:
                    kb[..., :n, :].copy_(keys)
                    vb[..., :n, :].copy_(values)
                if d.get("_length") is not None:
                    d["_keys"] = d["_values"] = None  # views of the old buffers: made again from the new
                self._key_buffer, self._value_buffer = kb, vb
            return kb, vb, n

        def commit(self, n: int) -> None:
            """The layer's keys and values are now the buffers' first ``n`` positions (views made when read)."""
            d = self.__dict__
            if d.get("_length") is None:  # the tensors assigned before (``reserve`` copied them in): not views
                d["_keys"] = d["_values"] = None
            d["_length"] = n

        def reset(self) -> None:
            self.__dict__["_length"] = None
            self._key_buffer = self._value_buffer = None
            super().reset()

    _CLASS.append(SpareLayer)
    return SpareLayer


def _buffer(like: torch.Tensor, capacity: int) -> torch.Tensor:
    b, h, _, d = like.shape
    return torch.empty(b, h, capacity, d, dtype=like.dtype, device=like.device)


def _fits(buf: torch.Tensor, new: torch.Tensor) -> bool:
    """Can ``new`` [B, H, t, D] be written into ``buf`` [B, H, capacity, D] (the room aside)?"""
    return (buf.dtype == new.dtype and buf.device == new.device and buf.shape[:2] == new.shape[:2]
            and buf.shape[-1] == new.shape[-1])


def _prefix_view(t: torch.Tensor, buf: torch.Tensor | None, new: torch.Tensor) -> bool:
    """Is ``t`` (empty, or 4-D) ``buf[..., :n, :]`` for a buffer that can take ``new`` after it?"""
    if buf is None or not _fits(buf, new):
        return False
    if t.dim() != 4:
        return t.numel() == 0
    return (t.shape[:2] == buf.shape[:2] and t.shape[-1] == buf.shape[-1] and t.data_ptr() == buf.data_ptr()
            and t.stride() == buf.stride())


def append_rows(buf: torch.Tensor | None, held: torch.Tensor | None, new: torch.Tensor):
    """``(buffer, held + new)`` along dim 0, the result a prefix view of a buffer with spare rows:
    ``new`` is written in place after ``held`` where ``held`` is the buffer's prefix and the room
    suffices, else both go to a new buffer (``GROWTH``, ``MIN_SPARE``)."""
    n, t = (0 if held is None else held.shape[0]), new.shape[0]
    if (buf is None or buf.dtype != new.dtype or buf.device != new.device or buf.shape[1:] != new.shape[1:]
            or n + t > buf.shape[0] or (n and (held.data_ptr() != buf.data_ptr() or held.stride() != buf.stride()))):
        fresh = torch.empty(n + t + max(MIN_SPARE, int((GROWTH - 1.0) * (n + t))), *new.shape[1:], dtype=new.dtype,
                            device=new.device)
        if n:
            fresh[:n].copy_(held)
        buf = fresh
    buf[n : n + t].copy_(new)
    return buf, buf[: n + t]
