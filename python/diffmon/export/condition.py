"""Conditional networks: the condition held fixed inside the exported file (a class label, the
null class, a fixed embedding, extra fixed inputs) and what the file's note records of it."""

from __future__ import annotations

import hashlib
import inspect
import os
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from .errors import ExportError


def _label_embeddings(module: nn.Module) -> list:
    """``(name, m)`` of the diffusers ``LabelEmbedding``s in ``module`` (recognized by class name
    and attributes, so diffusers need not be importable)."""
    return [(n, m) for n, m in module.named_modules()
            if type(m).__name__ == "LabelEmbedding" and hasattr(m, "num_classes") and hasattr(m, "dropout_prob")]


def is_class_conditional(module: nn.Module) -> bool:
    """Whether ``module`` has a class embedding: a ``class_embedding`` attribute that is not None
    (diffusers ``UNet2DModel``/``UNet2DConditionModel`` built with ``num_class_embeds`` or
    ``class_embed_type``) or a diffusers ``LabelEmbedding`` anywhere inside (``DiTTransformer2DModel``)."""
    return getattr(module, "class_embedding", None) is not None or bool(_label_embeddings(module))


def null_class(module: nn.Module) -> tuple:
    """``(index, rule)``: the class index that ``module`` was trained to treat as "no class" (the
    unconditional branch of classifier-free guidance), and a sentence saying how it was found.

    1. a diffusers ``LabelEmbedding`` with ``dropout_prob > 0`` (DiT's, inside
       ``CombinedTimestepLabelEmbeddings``): its table has ``num_classes + 1`` rows and training
       replaces dropped labels by ``num_classes``, so the null index is ``num_classes``;
    2. otherwise a ``class_embedding`` attribute that is an ``nn.Embedding`` of ``K`` rows
       (diffusers ``UNet2DModel(num_class_embeds=K)``): ``K - 1``, by the convention of reserving
       the last embedding for the unconditional case. diffusers itself reserves none: for a network
       trained on ``K`` real classes this is an ordinary class.

    Raises ExportError when neither applies (pass the class index explicitly)."""
    drop = [(n, m) for n, m in _label_embeddings(module) if float(m.dropout_prob) > 0]
    if drop:
        counts = sorted({int(m.num_classes) for _, m in drop})
        if len(counts) != 1:
            raise ExportError(f"{type(module).__name__} has LabelEmbeddings with different num_classes "
                              f"{counts}: pass the class index explicitly (condition=N / --class-label N)")
        k = counts[0]
        return k, (f"LabelEmbedding rule: {drop[0][0]} has dropout_prob {float(drop[0][1].dropout_prob):g} > 0, "
                   f"so its table has num_classes + 1 = {k + 1} rows and the null class is index "
                   f"num_classes = {k}")
    emb = getattr(module, "class_embedding", None)
    if isinstance(emb, nn.Embedding):
        k = int(emb.num_embeddings)
        return k - 1, (f"class_embedding rule: class_embedding is an nn.Embedding of {k} rows; the last, "
                       f"index {k - 1}, is taken as the reserved unconditional class")
    what = ("its LabelEmbedding has dropout_prob 0 (no null row)" if _label_embeddings(module) else
            "no class_embedding nn.Embedding" if emb is None else
            f"its class_embedding is a {type(emb).__name__}, not an nn.Embedding")
    raise ExportError(f"cannot find the null class of {type(module).__name__}: no diffusers LabelEmbedding "
                      f"with dropout_prob > 0 and {what}; pass the class index explicitly "
                      "(condition=N / --class-label N)")


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_safetensors(path: str) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= os.path.getsize(path) - 8


def load_embedding(path, key: Optional[str] = None) -> Tensor:
    """The one tensor in ``path``: a safetensors file (detected by content) or a ``torch.save``
    file (``torch.load(weights_only=True)``) holding a tensor or a dict of tensors. ``key`` names
    the tensor when the file holds several (dots for nested dicts). Raises ValueError otherwise."""
    path = str(path)
    if _is_safetensors(path):
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ValueError(f"{path} is a safetensors file: pip install safetensors") from e
        obj: Any = load_file(path, device="cpu")
    else:
        with open(path, "rb") as f:
            try:
                obj = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:
                raise ValueError(f"cannot read {path} as a tensor file (safetensors or torch.save): {e}") from e
    if key:
        for part in key.split("."):
            if not isinstance(obj, dict) or part not in obj:
                have = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"{path}: no key {key!r} (at {part!r}; found {have})")
            obj = obj[part]
    elif isinstance(obj, dict):
        tensors = [k for k, v in obj.items() if isinstance(v, Tensor)]
        if len(tensors) != 1:
            raise ValueError(f"{path} holds {len(tensors)} tensors ({', '.join(map(str, tensors)) or 'none'}); "
                             "name the one to use with key= (--embedding-key KEY)")
        obj = obj[tensors[0]]
    if not isinstance(obj, Tensor):
        raise ValueError(f"{path}: expected a tensor, found {type(obj).__name__}")
    return obj


class Embedding:
    """A conditioning tensor held fixed in the export (the empty-prompt embedding of a
    text-conditional network, ...): passed to the network as keyword ``keyword`` expanded to the
    batch. ``tensor`` is ``[L,D]`` or ``[1,L,D]`` (stored float32 as ``[1,L,D]``); ``file`` and
    ``sha256`` only describe its origin in the file's note (:meth:`from_file` sets them)."""

    def __init__(self, tensor: Tensor, keyword: str = "encoder_hidden_states", *,
                 file: Optional[str] = None, sha256: Optional[str] = None, pooled: bool = False):
        t = torch.as_tensor(tensor).detach()
        if not t.is_floating_point():
            raise ValueError(f"the embedding must be a floating-point tensor, got {t.dtype}")
        # A pooled embedding (SD3's pooled_projections) is one vector: [D] or [1,D].
        dims = 2 if pooled else 3
        if t.dim() == dims - 1:
            t = t.unsqueeze(0)
        if t.dim() != dims or t.shape[0] != 1:
            want = "[D] or [1,D]" if pooled else "[L,D] or [1,L,D]"
            raise ValueError(f"the {'pooled ' if pooled else ''}embedding must have shape {want}, "
                             f"got {list(tensor.shape)}")
        if t.numel() == 0:
            raise ValueError(f"the embedding has a zero-sized dimension ({list(tensor.shape)}): no condition")
        if not bool(torch.isfinite(t).all()):
            raise ValueError("the embedding holds NaN or infinite values: every output would too")
        self.pooled = bool(pooled)
        if not keyword or not str(keyword).isidentifier():
            raise ValueError(f"keyword must be a Python identifier, got {keyword!r}")
        self.tensor = t.to(device="cpu", dtype=torch.float32).contiguous()
        self.keyword = str(keyword)
        self.file = file
        self.sha256 = sha256

    @classmethod
    def from_file(cls, path, key: Optional[str] = None,
                  keyword: str = "encoder_hidden_states", pooled: bool = False) -> "Embedding":
        """:func:`load_embedding` of ``path``; the note records its basename and sha256."""
        try:
            return cls(load_embedding(path, key), keyword, file=os.path.basename(str(path)),
                       sha256=_sha256(path), pooled=pooled)
        except ValueError as e:
            if str(e).startswith(str(path)):
                raise
            raise ValueError(f"{path}: {e}") from None

    def expand(self, tensor: Tensor, batch: int) -> Tensor:
        """``tensor`` (this embedding on some device) expanded to the batch."""
        return tensor.expand(batch, *([-1] * (tensor.dim() - 1)))

    def note(self) -> dict:
        return {"kind": "embedding", "keyword": self.keyword, "file": self.file, "sha256": self.sha256,
                "shape": list(self.tensor.shape)}

    def __repr__(self) -> str:
        src = f" from {self.file}" if self.file else ""
        return f"Embedding({list(self.tensor.shape)}{src}, keyword={self.keyword!r})"


def _accepts_keyword(module: nn.Module, keyword: str) -> Optional[bool]:
    """Whether ``module.forward`` takes ``keyword`` (by name or ``**kwargs``); None if unknown."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return any(p.name == keyword and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD for p in params)


class _Condition:
    """What the exported file passes to the network besides (x, t): ``kwargs(t)`` and the note."""

    def __init__(self, keyword: Optional[str] = None, label: Optional[int] = None,
                 embedding: Optional[Embedding] = None, note: Optional[dict] = None, line: str = ""):
        self.keyword = keyword
        self.label = label
        self.embedding = embedding
        self.note = note
        self.line = line
        self._emb: Optional[Tensor] = None
        # Further fixed inputs: embeddings next to the condition (SD3's pooled_projections) and
        # constant keywords (PixArt's added_cond_kwargs); see _fixed_inputs.
        self.extra: list = []
        self._extra: list = []
        self.constants: dict = {}

    def to(self, device: torch.device) -> "_Condition":
        if self.embedding is not None:
            # A graph constant of the trace, like the VP schedule table: it follows the load device.
            self._emb = self.embedding.tensor.to(device)
        self._extra = [(e, e.tensor.to(device)) for e in self.extra]
        return self

    def kwargs(self, x: Tensor, t: Tensor) -> dict:
        out: dict = dict(self.constants)
        for e, tensor in self._extra:
            out[e.keyword] = e.expand(tensor, x.shape[0])
        if self.label is not None:
            # Made from the [B] time tensor, so it follows the batch size and device under tracing.
            out[self.keyword] = torch.zeros_like(t, dtype=torch.long) + self.label
        elif self._emb is not None:
            out[self.keyword] = self._emb.expand(x.shape[0], -1, -1)
        return out


def _resolve_condition(module: nn.Module, condition: Any, class_keyword: str) -> _Condition:
    """The condition ``export`` applies (module docstring, "Conditional networks")."""
    if not class_keyword or not str(class_keyword).isidentifier():
        raise ValueError(f"class_keyword must be a Python identifier, got {class_keyword!r}")
    name = type(module).__name__
    if condition is None:
        return _Condition()
    if isinstance(condition, Embedding):
        if _accepts_keyword(module, condition.keyword) is False:
            raise ExportError(f"{name}.forward takes no keyword {condition.keyword!r}; name the network's "
                              "keyword with Embedding(..., keyword=...) (--embedding-keyword)")
        shape = "x".join(str(v) for v in condition.tensor.shape)
        src = f" from {condition.file} (sha256 {condition.sha256[:12]}...)" if condition.file else ""
        return _Condition(keyword=condition.keyword, embedding=condition, note=condition.note(),
                          line=f"condition: {condition.keyword} = the [{shape}] embedding{src}, expanded to the batch")
    default = False
    if isinstance(condition, str) and condition == "auto":
        if not is_class_conditional(module) or not _accepts_keyword(module, class_keyword):
            return _Condition()  # not class-conditional, or a wrapper that fixes the label itself
        default, condition = True, "null"
    if isinstance(condition, str) and condition == "null":
        try:
            label, rule = null_class(module)
        except ExportError as e:
            if default:
                raise ExportError(f"{name} is class-conditional and the null class is the default "
                                  f"condition, but {e}; or refuse the default with condition=None "
                                  "(--no-condition)") from None
            raise
        null = True
    elif isinstance(condition, int) and not isinstance(condition, bool):
        label = int(condition)
        if label < 0:
            raise ValueError(f"a class index must be >= 0, got {label}")
        try:
            null_label, null_rule = null_class(module)
        except ExportError:
            null_label, null_rule = None, None
        null = label == null_label
        rule = null_rule if null else None
    else:
        raise ValueError("condition must be 'auto', None, 'null', a class index (int) or an Embedding, "
                         f"got {condition!r}")
    if _accepts_keyword(module, class_keyword) is False:
        raise ExportError(f"{name}.forward takes no keyword {class_keyword!r}; name the network's class "
                          "keyword with class_keyword= (--class-keyword)")
    note = {"kind": "class", "keyword": class_keyword, "label": label, "null_class": null, "rule": rule,
            "default": default}
    line = f"condition: {class_keyword}={label}"
    if null:
        line += f", the null class ({rule})"
    if default:
        line += ("; taken by default because the network is class-conditional "
                 "(condition=N / --class-label N for a class, condition=None / --no-condition for none)")
    return _Condition(keyword=class_keyword, label=label, note=note, line=line)


# The names under which diffusers' transformers take the time when it is not their second argument
# (SD3Transformer2DModel.forward(hidden_states, encoder_hidden_states, pooled_projections,
# timestep), PixArtTransformer2DModel.forward(hidden_states, encoder_hidden_states, timestep, ...)).
_TIME_KEYWORDS = ("timestep", "timesteps")
_WRAPPER_HINT = ("a network whose forward needs more than (x, t) and one condition is exported through a "
                 "wrapper: a subclass whose forward(x, t) supplies the rest "
                 '(docs/guide/model-contract.md, "Conditional networks")')


def _time_keyword(module: nn.Module) -> Optional[str]:
    """The keyword to pass the time as, or None to pass it second, positionally: a forward whose
    second parameter is not the time but which has a ``timestep`` parameter further on (diffusers'
    SD3 and PixArt transformers) gets it by name."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 or positional[1].name in _TIME_KEYWORDS:
        return None
    later = [p.name for p in params[2:] if p.name in _TIME_KEYWORDS and p.kind != p.POSITIONAL_ONLY]
    return later[0] if later else None


def _named_parameter(module: nn.Module, name: str) -> bool:
    """Whether ``module.forward`` has a parameter of that name (``**kwargs`` does not count)."""
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _fixed_inputs(module: nn.Module, cond: _Condition, extra: Sequence[Embedding]) -> _Condition:
    """Adds to ``cond`` the network's other fixed inputs: the ``extra`` embeddings (an SD3-style
    transformer's ``pooled_projections``) and PixArt's ``added_cond_kwargs``; a one-line
    :class:`ExportError` for an input the exporter cannot supply."""
    name = type(module).__name__
    for e in extra:
        if not isinstance(e, Embedding):
            raise ValueError(f"extra conditions must be Embeddings, got {type(e).__name__}")
        if e.keyword == cond.keyword:
            raise ValueError(f"the keyword {e.keyword!r} is given twice")
        if _accepts_keyword(module, e.keyword) is False:
            raise ExportError(f"{name}.forward takes no keyword {e.keyword!r}")
    cond.extra = list(extra)
    given = {e.keyword for e in extra} | ({cond.keyword} if cond.keyword else set())
    if _named_parameter(module, "pooled_projections") and "pooled_projections" not in given:
        raise ExportError(f"{name} is an SD3-style transformer: it needs encoder_hidden_states and "
                          "pooled_projections; give both, e.g. the empty prompt's (--embedding FILE "
                          "--pooled-embedding FILE), or " + _WRAPPER_HINT)
    if _named_parameter(module, "added_cond_kwargs") and "added_cond_kwargs" not in given:
        if getattr(module, "use_additional_conditions", False):
            raise ExportError(f"{name} uses additional conditions (resolution and aspect ratio in "
                              "added_cond_kwargs), which the exporter does not supply: " + _WRAPPER_HINT)
        # PixArt without additional conditions still indexes the dict.
        cond.constants["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
    if extra:
        cond.note = dict(cond.note or {"kind": "none"})
        cond.note["extra"] = [e.note() for e in extra]
        cond.line = "; ".join(filter(None, [cond.line] + [
            f"{e.keyword} = the [{'x'.join(str(v) for v in e.tensor.shape)}] embedding"
            + (f" from {e.file}" if e.file else "") + ", expanded to the batch" for e in extra]))
        if not cond.line.startswith("condition"):
            cond.line = "condition: " + cond.line
    return cond
