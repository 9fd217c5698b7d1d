"""Export any ``torch.nn.Module`` to the diffmon model contract (docs/design.md §11).

The exported TorchScript file has one method::

    forward(x: Tensor[B,C,H,W] float32, sigma: Tensor[B] float32)
        -> (denoised: Tensor[B,C,H,W], features: Tensor[B,C',H',W'] or Tensor[B,d])

``denoised`` is the EDM denoiser D(x; sigma) ~ E[x0 | x] for ``x = x0 + sigma * n``, whatever the
network's own parameterization; ``features`` is the output of the submodule named
``feature_layer`` (a dotted name as listed by ``module.named_modules()``), captured during the
same forward pass. A conditional network is exported with its condition held fixed (a class
label, the null class, or a fixed embedding: "Conditional networks" below); :func:`export_vae`
writes a VAE's ``encode``/``decode`` into a file of its own ("The VAE file").

How the feature layer is captured
---------------------------------
Python forward hooks are not part of TorchScript, so a hook on the exported file would be lost.
Instead the module is *traced* (``torch.jit.trace``) while a forward hook is installed that stashes
the layer's output, and the traced function returns that stashed tensor next to the denoised
image. Tracing records tensor operations, not Python, so the stashed value simply becomes an extra
output of the graph; for a nested layer the tracer threads it out through every enclosing
submodule (their traced ``forward`` methods return an extra value). The hook stores a ``clone()``
of the output so that a later in-place op (``ReLU(inplace=True)``) cannot alter it.

The trace is made on a deep copy of the module in eval mode whose ``forward`` is replaced by the
conversion function, so the exported file's parameters and buffers carry exactly the names of
``module.state_dict()`` (no wrapper prefix): checkpoints saved with
``torch.save(module.state_dict())`` load into it by name. The conversion's own constants (noise
schedule tables) are graph constants, not buffers, so they never show up as extra keys.

Limits (the usual ones of tracing): Python control flow that depends on tensor *values* or on the
batch size is frozen at the traced example (B=2); ``export`` re-runs the reloaded file at B=3 on
different noise levels and compares it with the eager module, so such a freeze is normally caught
and raised as :class:`ExportError`, but a branch that the check inputs happen to take the same
way as the trace is not. The network must be callable as ``module(x, sigma_or_t)``, plus the
keyword arguments of a fixed condition ("Conditional networks"); a forward whose second
parameter is not the time but which takes ``timestep`` further on (diffusers'
``SD3Transformer2DModel`` and ``PixArtTransformer2DModel``) gets the time as ``timestep=``. Its
output may be a tensor, a tuple/list whose first item is the tensor, or an object with a
``.sample`` attribute (diffusers). Any other failure of the first, eager call is an
:class:`ExportError` naming the call made and the wrapper to write. The feature layer must run
exactly once per forward and return a tensor, or a tuple whose last tensor is taken (a joint
MMDiT block of SD3/Flux returns ``(encoder_hidden_states, hidden_states)``: the image tokens); a
``[B,L,D]`` token output (a transformer block's) is mean-pooled over ``L`` to ``[B,D]``.

Tracer warnings. ``torch.jit.trace`` warns (``torch.jit.TracerWarning``) wherever Python reads a
tensor's value, since the trace keeps the value it saw, not how it was computed. The export
filters the warnings it knows to be harmless (:data:`_HARMLESS_TRACER_WARNINGS`) and keeps every
other one, in particular those of the network's own code, which can point at a real freeze:

* from ``torch.nn.functional``: its own batch-size sanity checks (``group_norm``, ...);
* from diffusers' modules (``diffusers.*``), "Converting a tensor to a Python boolean/integer":
  its checks of the channel count (``assert hidden_states.shape[1] == self.channels`` in the
  down- and upsamplers) and of the spatial size (``PatchEmbed``'s positional-embedding size, a
  ``UNet2DConditionModel``'s upsample size, a DiT's unpatchify size), and its memory-layout
  workarounds (``.contiguous()`` for a batch of 64 or more: the same values either way). The
  channels and the spatial size are the example shape's, which the file is made for, and the
  export re-runs the reloaded file at batch 3 on other noise levels and compares it with the
  eager module, so a frozen branch that changes the result is still an :class:`ExportError`.

Learned sigma. A DiT-style network trained with ``learn_sigma`` outputs ``2C`` channels for a
``C``-channel input: the prediction, then the variance interpolation (as diffusers' DiT pipeline
and the DiT/iDDPM code split it). Such an output is cut to its first ``C`` channels before the
conversion below, and the note records ``"learned_sigma": true``. Any other channel count that
differs from the input's is an :class:`ExportError`.

Conditional networks
--------------------
The exported file keeps the two inputs ``(x, sigma)``: a condition is held fixed in it, and
ICR and PFD then describe the model under that condition. ``export(..., condition=...)``:

* ``"auto"`` (the default): the null class if the module is class-conditional, i.e. has a
  ``class_embedding`` that is not None (diffusers ``UNet2DModel(num_class_embeds=K)``) or contains
  a diffusers ``LabelEmbedding`` (``DiTTransformer2DModel``), and its ``forward`` takes the class
  keyword (so a wrapper whose ``forward(x, t)`` fixes the label itself is left alone); nothing
  otherwise. The ICR paper evaluates class-conditional models "using the null class". The
  default, when taken, is printed and recorded (``"default": true``).
* ``None``: the network is called with no condition (``--no-condition``).
* ``"null"``: the null class, an error if it cannot be found (``--null-class``).
* an ``int``: that class index (``--class-label N``).
* an :class:`Embedding`: a fixed tensor, e.g. the empty-prompt embedding of a text-conditional
  ``UNet2DConditionModel`` (``--embedding FILE``).

Class labels are passed as ``module(x_net, t, class_labels=labels)`` (``class_keyword``,
``--class-keyword``), ``labels`` an int64 ``[B]`` tensor made as ``zeros_like(t, dtype=long) +
index``: it follows the batch size and device of the input, in the trace too.

The null class is found by :func:`null_class`, in this order: (1) a diffusers ``LabelEmbedding``
with ``dropout_prob > 0`` (DiT's, in ``CombinedTimestepLabelEmbeddings``) has ``num_classes + 1``
rows and training replaces dropped labels by ``num_classes``: the null index is ``num_classes``;
(2) otherwise a ``class_embedding`` attribute that is an ``nn.Embedding`` of ``K`` rows: the null
index is ``K - 1``, by the convention of reserving the last embedding for the unconditional case.
This is a convention, not something diffusers enforces: a ``UNet2DModel(num_class_embeds=K)``
trained on ``K`` real classes without label dropout has no null class, and ``K - 1`` is then an
ordinary class (pass ``--class-label`` or ``--no-condition``). When neither rule applies, asking
for the null class (or taking the default) is an :class:`ExportError` asking for the index. The
printed line and the note name the rule used.

An :class:`Embedding` holds a ``[L,D]`` or ``[1,L,D]`` float tensor (``Embedding.from_file``:
a ``torch.save`` file read with ``torch.load(weights_only=True)`` holding a tensor or a dict of
tensors, or a safetensors file; ``key`` / ``--embedding-key`` names the tensor when the file holds
more than one). It is passed as ``encoder_hidden_states`` (``keyword``, ``--embedding-keyword``),
expanded to ``[B,L,D]``; in the file it is a graph constant, like the VP schedule table, and
follows the load device. One condition is fixed per export, plus ``extra_conditions``: further
embeddings, each under its own keyword, such as an SD3-style transformer's pooled text embedding
(``Embedding(t, "pooled_projections", pooled=True)``, ``[D]`` or ``[1,D]``; ``--pooled-embedding
FILE``). An SD3-style forward (one with a ``pooled_projections`` parameter) without it is an
:class:`ExportError`. A PixArt transformer without additional conditions gets
``added_cond_kwargs={"resolution": None, "aspect_ratio": None}``; one with them
(``use_additional_conditions``, a 1024-pixel PixArt) is an :class:`ExportError`. A network that
needs more (a class and a prompt) is wrapped by hand, its ``forward(x, t)`` supplying them.

Choosing the feature layer
--------------------------
:func:`suggest_feature_layer` returns ``mid_block`` (a U-Net's bottleneck) when the module has
one, else the middle block, index ``(n-1)//2``, of the longest ``nn.ModuleList`` named like
``*blocks`` (``transformer_blocks.13`` of a 28-block DiT: block 14 of 28, the ICR paper's choice
for SiT-XL/2). ``--list-layers`` prints ``name<TAB>Type`` for every submodule and appends
``<TAB>(mark)`` to the marked ones: ``middle of N`` on the middle block of each ModuleList of
blocks (of at least 2), ``U-Net middle block`` on ``mid_block``, ``suggested`` on the suggestion,
e.g. ``transformer_blocks.5<TAB>BasicTransformerBlock<TAB>(middle of 12, suggested)``.

The note
--------
The file holds ``extra/diffmon.json``::

    {"non_persistent_buffers": [...], "device_independent": true, "torch": "2.13.0",
     "feature_layer": "mid_block", "parameterization": "eps", "learned_sigma": false,
     "condition": null, "family": "vp", "path": null, "prediction": "eps", "schedule": "linear"}

``family`` (``edm``, ``vp``, ``flow``), ``path`` (a flow path of :data:`FLOW_PATHS`, else null)
and ``prediction`` come from :data:`PARAMETERIZATION_TABLE`; ``schedule`` is a VP network's
(``alphas_cumprod`` for an explicit table), ``t_scale`` a flow or continuous-VP network's time
scale. ``diffmon check-config`` prints them, and for a flow path ``icr.sigma`` in its time.

``condition`` is ``null`` (no condition), or ``{"kind": "class", "keyword": "class_labels",
"label": 10, "null_class": true, "rule": "<how the null index was found>", "default": true}``
(``null_class``: the label is the null class as :func:`null_class` finds it; ``rule``: null when
it is not; ``default``: the condition was taken by default), or ``{"kind": "embedding",
"keyword": "encoder_hidden_states", "file": "<basename>", "sha256": "<hex of the file>", "shape":
[1, L, D]}`` (``file`` and ``sha256`` are null for an :class:`Embedding` made from a tensor).
Extra conditions add ``"extra": [<embedding notes>]`` (a condition that is otherwise none is
``{"kind": "none", "extra": [...]}``).

The VAE file
------------
``export_vae(vae, path, example_shape, scaling_factor=None, shift_factor=None)`` exports a
diffusers ``AutoencoderKL`` (or anything with its ``encode(x).latent_dist`` / ``decode(z).sample``
interface) to one TorchScript file with the methods

* ``encode(x [B,C,H,W] float32 pixels in [-1,1]) -> [B,c,h,w]`` =
  ``(posterior mean - shift_factor) * scaling_factor``;
* ``decode(z) -> [B,C,H,W]`` = ``vae.decode(z / scaling_factor + shift_factor).sample``;
* ``forward`` = ``encode``.

``encode`` is the posterior *mean*, not a sample: the same image gives the same latent at every
checkpoint and on every call, so the latent data set is fixed; diffusers' pipelines and training
scripts draw ``latent_dist.sample()``, which adds ``std * noise``. ``scaling_factor`` and
``shift_factor`` default to ``vae.config.scaling_factor`` / ``vae.config.shift_factor`` (missing
or None: 1.0 / 0.0). The methods are traced with ``torch.jit.trace_module`` at batch 2 on the
VAE itself (parameter names are those of ``vae.state_dict()``), every method graph gets the
device rewrite below, and the reloaded file is compared with the eager VAE at batch 3, both
methods. Its note: ``{"kind": "vae", "scaling_factor": 0.18215, "shift_factor": 0.0, "encode":
"posterior mean", "image_shape": [C,H,W], "latent_shape": [c,h,w], "non_persistent_buffers":
[...], "device_independent": true, "torch": "2.13.0"}``.

Device independence
-------------------
Tracing freezes the device of tensors a network creates itself: diffusers' ``torch.ones(B,
device=timesteps.device)`` is recorded as ``device=torch.device("cpu")`` (a ``prim::Constant`` of
type ``Device``), so a file traced on the CPU would fail on CUDA and the other way round. After
tracing, ``export`` rewrites every such constant, in every method graph of the module and of all
its submodules, to ``prim::device(t)`` of that graph's first tensor input ``t`` (``x`` for the
top-level ``forward``): the created tensors then follow the input's device. A graph with a device
constant but no tensor input cannot be rewritten and is an :class:`ExportError`. After saving,
the reloaded file is checked to hold no device constant (:func:`device_constants` lists them,
with the op that uses each); the file's ``diffmon.json`` note records ``"device_independent":
true`` and the torch version. Tensor constants (the VP schedule table) are not device constants:
they follow the device the file is loaded on (``map_location`` / ``CModule::load_on_device``).
Dtype constants are left alone: they do not depend on the device.

Parameterizations
-----------------
One table, :data:`PARAMETERIZATION_TABLE`, names them (``--help`` prints its one-line helps); a
name outside it is a ValueError, and the converter's last branch raises rather than assume one.

``edm``      ``module(x, sigma)`` already returns D(x; sigma).
``edm_raw``  ``module(c_in x, c_noise)`` returns the raw network output F of Karras et al. (2022):
             ``D = c_skip x + c_out F`` with ``c_skip = sd^2/(sigma^2+sd^2)``,
             ``c_out = sigma sd / sqrt(sigma^2+sd^2)``, ``c_in = 1/sqrt(sigma^2+sd^2)``,
             ``c_noise = ln(sigma)/4`` and ``sd = sigma_data``.
``eps``      VP epsilon prediction ``module(x_vp, t) ~ E[n | x_vp]``.
``v``        VP v-prediction ``module(x_vp, t) ~ E[v | x_vp]``, ``v = alpha n - s x0``.
``x0``       VP data prediction ``module(x_vp, t) ~ E[x0 | x_vp]``.

VP <-> EDM. A VP state is ``x_vp = alpha x0 + s n`` with ``alpha^2 + s^2 = 1``. Dividing by alpha
gives the EDM state ``x = x_vp / alpha = x0 + (s/alpha) n``, so ``sigma = s/alpha``,
``alpha = 1/sqrt(1+sigma^2)``, ``s = sigma/sqrt(1+sigma^2)`` and the network input is
``x_vp = x / sqrt(1+sigma^2)``. Then, with ``n = (x - x0)/sigma``:

* eps: ``D = x - sigma * eps``.
* v:   ``x0 = alpha x_vp - s v`` (because ``alpha x_vp - s v = alpha^2 x0 + alpha s n - s alpha n
  + s^2 x0 = x0``), so ``D = x / (1+sigma^2) - sigma / sqrt(1+sigma^2) * v``. This is the EDM
  preconditioning with ``sigma_data = 1`` and ``F = -v``.
* x0:  ``D = x0``.

The scale factors always use the requested sigma itself (as in the ``iDDPMPrecond`` of the EDM
code); only the timestep handed to the network is derived from the schedule:

* ``schedule="linear"`` (default; DDPM: betas = linspace(beta_min, beta_max, T), defaults 1e-4,
  0.02, 1000), ``"scaled_linear"`` (betas = linspace(sqrt(beta_min), sqrt(beta_max), T)^2, Stable
  Diffusion's, defaults 0.00085, 0.012), ``"cosine"`` (Nichol & Dhariwal, s = 0.008, betas
  clipped at 0.999), or an explicit ``alphas_cumprod`` table: discrete timesteps ``t = 0..T-1``
  with ``alphabar_t = prod_{i<=t} (1 - beta_i)`` and ``sigma_t = sqrt((1-alphabar_t)/alphabar_t)``.
  ``timestep="nearest"`` (default) passes the int64 index whose ``sigma_t`` is nearest to sigma in
  log space; ``timestep="interp"`` passes a float32 fractional index, linear in ``log sigma_t``
  between the two neighbouring indices (clamped to ``[0, T-1]``), for networks whose time
  embedding accepts non-integer times.
* ``schedule="continuous"``: the VP SDE of Song et al. with linear ``beta(t) = beta_min +
  t (beta_max - beta_min)``, ``t`` in ``[0, 1]`` (defaults 0.1, 20), ``alphabar(t) =
  exp(-beta_min t - (beta_max-beta_min) t^2 / 2)``; the exact inverse
  ``t = (sqrt(beta_min^2 + 2 (beta_max-beta_min) ln(1+sigma^2)) - beta_min) / (beta_max-beta_min)``
  is used and the network receives ``t * t_scale`` (default 999, as in score_sde / EDM's
  ``VPPrecond``), float32, not clamped.

``sigma_data`` is used by ``edm_raw`` only.

Flow matching
-------------
A flow path writes ``x_t = alpha_t x + sigma_t n``; dividing by ``alpha_t`` gives the EDM state
``x + (sigma_t/alpha_t) n``, so ``sigma = sigma_t / alpha_t``. The file finds the path's time ``t``
at ``sigma`` (:func:`flow_time`), hands the network ``x_t = alpha_t x`` and ``t * t_scale``
(float32), and turns the prediction into ``D = (x_t - sigma_t n_hat) / alpha_t``:

* ``rectified_flow``: ``alpha = 1 - t``, ``sigma_t = t`` (data at t = 0; SD3, Flux, diffusers'
  ``FlowMatchEulerDiscreteScheduler``), predicts ``v = n - x``; ``t_scale`` defaults to 1000
  (diffusers passes ``t * 1000``; Flux's transformer takes ``t``: ``t_scale=1``).
* ``cosine_flow``: ``alpha = cos(pi t/2)``, ``sigma_t = sin(pi t/2)`` (data at t = 0, REPA's
  cosine path), predicts ``dx_t/dt``.
* ``sit_{linear,gvp}_{velocity,score,noise}``: SiT's code, data at t = 1: Linear ``alpha = t``,
  ``sigma_t = 1 - t``; GVP ``alpha = sin(pi t/2)``, ``sigma_t = cos(pi t/2)``. ``t_scale``
  defaults to 1.

A velocity ``u = alpha' x + sigma_t' n`` gives ``D = (sigma_t u - sigma_t' x_t) / (alpha' sigma_t -
alpha sigma_t')``; a noise prediction ``D = x - sigma n_hat``; a score ``s = -n / sigma_t`` gives
``D = x + sigma sigma_t s``. The VP schedule options are refused with a flow parameterization. A
timestep shift (SD3's ``shift``, Flux's) is the sampler's: it changes which ``t`` are visited, not
what the network computes at ``t``, and nothing here reads it. docs/guide/model-contract.md
derives each conversion and says how SiT's paper and code count time.

What a wrong parameterization does
----------------------------------
``scheduler=`` (``--scheduler``) names the diffusers scheduler the network trained with (a
``scheduler_config.json`` or its folder, read as JSON): :func:`scheduler_mismatches` compares its
class (``FlowMatch*`` demands ``rectified_flow``), ``prediction_type``, ``beta_schedule``,
``beta_start``/``beta_end`` and ``num_train_timesteps`` with the export, and, when diffusers is
importable, :func:`scheduler_round_trip` noises one image with the scheduler itself at four of its
timesteps and compares the network input the export would make. A mismatch is an
:class:`ExportError` before anything is written. Without a scheduler, ``warn_inconsistent=True``
(the command line sets it for ``--weights`` or a ``from_pretrained`` factory) prints
:func:`consistency_warning`'s warning when the denoised output from pure noise grows with sigma
(20 to 80; within a discrete VP schedule's range when it ends lower, as Stable Diffusion's at
14.6), as a flow network read as ``eps`` does; it cannot judge an untrained network, data of
mean near zero, or two flow paths against each other.

Command line
------------
``diffmon-export`` (installed with the ``diffmon`` binary by ``pip install ./``; ``pip install
./python`` installs the helpers alone, only for environments that never run the daemon, and
replaces the binary) and ``python -m diffmon.export`` are the same program.
``--factory module:attr.attr`` names a callable (dotted attributes after the colon are followed)
that returns the module, called with the JSON ``--factory-kwargs``; ``--weights`` then loads a
state_dict into it, read by content: a safetensors file (with the ``safetensors``
package) or a ``torch.save`` file (``torch.load(weights_only=True)``, optionally nested under
``--weights-key``), with ``--strip-prefix`` removed from the names.

A diffusers model saved with ``save_pretrained`` (``checkpoint-500/unet``, as diffusers'
``train_unconditional.py`` writes it) is built by its own ``from_pretrained``::

    diffmon-export --factory diffusers:UNet2DModel.from_pretrained \
        --factory-kwargs '{"pretrained_model_name_or_path": "run/checkpoint-500/unet"}' \
        --feature-layer mid_block --shape 3 64 64 --out run/model.ts \
        --parameterization eps --schedule linear --T 1000

A UNet trained with ``DDPMScheduler`` predicts the noise (``prediction_type="epsilon"``, the
default: ``--parameterization eps``; ``"v_prediction"`` is ``v``, ``"sample"`` is ``x0``) on the
schedule of its ``scheduler_config.json``: ``beta_schedule="linear"`` is ``--schedule linear``
with ``--beta-min``/``--beta-max`` = ``beta_start``/``beta_end`` (defaults 1e-4, 0.02, as
DDPMScheduler's) and ``--T`` = ``num_train_timesteps`` (1000); ``"scaled_linear"`` and
``"squaredcos_cap_v2"`` are ``--schedule scaled_linear`` and ``cosine``. The exported file's
parameter names are those of ``unet.state_dict()``, so every later ``checkpoint-N`` of the run
loads into it. Before the run has saved one, the class itself is the factory, called with the
config training builds it with (``--factory diffusers:UNet2DModel --factory-kwargs
'{"sample_size": 64, ...}'``; docs/guide/training-stacks.md, "Before the first checkpoint").

Conditions (one of): ``--class-label N``, ``--null-class``, ``--no-condition``, ``--embedding
FILE [--embedding-key KEY] [--embedding-keyword encoder_hidden_states]``; ``--class-keyword
class_labels`` names the class keyword. Without one, a class-conditional network gets its null
class. A text-conditional UNet held at its empty-prompt embedding (saved with
``torch.save(pipe.encode_prompt("", ...)[0], "empty_prompt.pt")`` or as a one-tensor safetensors
file)::

    diffmon-export --factory diffusers:UNet2DConditionModel.from_pretrained \
        --factory-kwargs '{"pretrained_model_name_or_path": "run/checkpoint-500/unet"}' \
        --embedding empty_prompt.pt --feature-layer mid_block --shape 4 32 32 \
        --out run/model.ts --parameterization eps --schedule scaled_linear

``--vae`` exports a VAE instead (``--feature-layer``, ``--parameterization``, the schedule and the
condition options are refused)::

    diffmon-export --vae --factory diffusers:AutoencoderKL.from_pretrained \
        --factory-kwargs '{"pretrained_model_name_or_path": "models/sd/vae"}' \
        --shape 3 256 256 --out vae.ts [--scaling-factor F] [--shift-factor F]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib
import inspect
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "export",
    "export_vae",
    "ExportError",
    "Embedding",
    "load_embedding",
    "null_class",
    "is_class_conditional",
    "suggest_feature_layer",
    "device_constants",
    "PARAMETERIZATIONS",
    "PARAMETERIZATION_TABLE",
    "Parameterization",
    "FLOW_PATHS",
    "flow_time",
    "SCHEDULES",
    "vp_alphas_cumprod",
    "edm_sampling_sigmas",
]

class Parameterization(NamedTuple):
    """One row of :data:`PARAMETERIZATION_TABLE`: what the network computes and on which path.

    ``family`` is ``"edm"``, ``"vp"`` (DDPM-style, a VP noise schedule) or ``"flow"`` (flow
    matching); ``path`` names a flow path (``None`` otherwise); ``prediction`` is what the network
    returns; ``help`` is the one line ``diffmon-export --help`` prints."""
    name: str
    family: str
    path: Optional[str]
    prediction: str
    help: str


# The parameterizations, in one table: the converter, the note and --help all read it.
PARAMETERIZATION_TABLE = (
    Parameterization("edm", "edm", None, "denoiser",
                     "module(x, sigma) already returns the EDM denoiser D(x; sigma)"),
    Parameterization("edm_raw", "edm", None, "raw",
                     "module(c_in x, ln(sigma)/4) returns EDM's raw F: D = c_skip x + c_out F (--sigma-data)"),
    Parameterization("eps", "vp", None, "eps",
                     "DDPM-style: module(x_t, t) predicts the noise on a VP schedule (--schedule)"),
    Parameterization("v", "vp", None, "v",
                     "DDPM-style: module(x_t, t) predicts v = alpha n - s x0 on a VP schedule"),
    Parameterization("x0", "vp", None, "x0",
                     "DDPM-style: module(x_t, t) predicts the clean image x0 on a VP schedule"),
    Parameterization("rectified_flow", "flow", "rectified_flow", "velocity",
                     "flow matching, x_t = (1-t) x + t n (SD3, Flux, FlowMatch* schedulers); predicts n - x"),
    Parameterization("cosine_flow", "flow", "cosine", "velocity",
                     "flow matching, x_t = cos(pi t/2) x + sin(pi t/2) n (REPA's cosine path); predicts dx_t/dt"),
    Parameterization("sit_linear_velocity", "flow", "sit_linear", "velocity",
                     "SiT Linear, data at t = 1 (SiT's code): x_t = t x + (1-t) n; predicts x - n"),
    Parameterization("sit_linear_score", "flow", "sit_linear", "score",
                     "SiT Linear: predicts the score -n / (1-t)"),
    Parameterization("sit_linear_noise", "flow", "sit_linear", "noise",
                     "SiT Linear: predicts the noise n"),
    Parameterization("sit_gvp_velocity", "flow", "sit_gvp", "velocity",
                     "SiT GVP, data at t = 1: x_t = sin(pi t/2) x + cos(pi t/2) n; predicts dx_t/dt"),
    Parameterization("sit_gvp_score", "flow", "sit_gvp", "score",
                     "SiT GVP: predicts the score -n / cos(pi t/2)"),
    Parameterization("sit_gvp_noise", "flow", "sit_gvp", "noise",
                     "SiT GVP: predicts the noise n"),
)
_BY_NAME = {p.name: p for p in PARAMETERIZATION_TABLE}
PARAMETERIZATIONS = tuple(_BY_NAME)
# The flow paths: how each is written in the note and what check-config calls it.
FLOW_PATHS = {
    "rectified_flow": "rectified flow, x_t = (1-t) x + t n, data at t = 0",
    "cosine": "cosine, x_t = cos(pi t/2) x + sin(pi t/2) n, data at t = 0",
    "sit_linear": "SiT Linear, x_t = t x + (1-t) n, data at t = 1 (SiT's code)",
    "sit_gvp": "SiT GVP, x_t = sin(pi t/2) x + cos(pi t/2) n, data at t = 1 (SiT's code)",
}
SCHEDULES = ("linear", "scaled_linear", "cosine", "continuous")

_DEFAULT_BETAS = {
    "linear": (1e-4, 0.02),
    "scaled_linear": (0.00085, 0.012),
    "continuous": (0.1, 20.0),
}


class ExportError(RuntimeError):
    """The module cannot be exported, or the exported file does not reproduce it."""


def vp_alphas_cumprod(schedule: str = "linear", beta_min: Optional[float] = None,
                      beta_max: Optional[float] = None, T: int = 1000) -> Tensor:
    """alphabar_t, t = 0..T-1, of a discrete VP schedule (float64)."""
    if T < 2:
        raise ValueError(f"T must be >= 2, got {T}")
    if schedule == "cosine":
        s = 0.008

        def f(u: Tensor) -> Tensor:
            return torch.cos((u + s) / (1 + s) * math.pi / 2) ** 2

        i = torch.arange(T, dtype=torch.float64)
        betas = (1 - f((i + 1) / T) / f(i / T)).clamp(max=0.999)
    elif schedule in ("linear", "scaled_linear"):
        lo, hi = _DEFAULT_BETAS[schedule]
        lo = lo if beta_min is None else float(beta_min)
        hi = hi if beta_max is None else float(beta_max)
        if not (0 < lo <= hi < 1):
            raise ValueError(f"need 0 < beta_min <= beta_max < 1, got {lo}, {hi}")
        if schedule == "linear":
            betas = torch.linspace(lo, hi, T, dtype=torch.float64)
        else:
            betas = torch.linspace(math.sqrt(lo), math.sqrt(hi), T, dtype=torch.float64) ** 2
    else:
        raise ValueError(f"unknown discrete schedule {schedule!r}")
    return torch.cumprod(1 - betas, dim=0)


def edm_sampling_sigmas(n: int = 18, sigma_min: float = 0.002, sigma_max: float = 80.0,
                        rho: float = 7.0) -> Tensor:
    """The EDM sampling noise levels t_0 > ... > t_{n-1} (float64, docs/design.md §3)."""
    i = torch.arange(n, dtype=torch.float64)
    return (sigma_max ** (1 / rho) + i / (n - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


def flow_time(path: str, sigma):
    """The time ``t`` on a flow path (:data:`FLOW_PATHS`) that holds the EDM noise level
    ``sigma`` (a float or a tensor), as the network takes it before any ``t_scale``:

    * ``rectified_flow`` (data at t = 0): ``t = sigma / (1 + sigma)``;
    * ``cosine`` (data at t = 0): ``t = (2/pi) atan(sigma)``;
    * ``sit_linear`` (data at t = 1, SiT's code): ``t = 1 / (1 + sigma)``;
    * ``sit_gvp`` (data at t = 1): ``t = (2/pi) atan(1/sigma)``.

    In the SiT paper's convention (data at t = 0) a SiT time is ``1 - t``."""
    s = sigma.to(torch.float64) if isinstance(sigma, Tensor) else torch.tensor(float(sigma), dtype=torch.float64)
    if path == "rectified_flow":
        t = s / (1 + s)
    elif path == "cosine":
        t = (2 / math.pi) * torch.atan(s)
    elif path == "sit_linear":
        t = 1 / (1 + s)
    elif path == "sit_gvp":
        t = (2 / math.pi) * torch.atan2(torch.ones_like(s), s)
    else:
        raise ValueError(f"unknown flow path {path!r}; one of {tuple(FLOW_PATHS)}")
    return float(t) if t.dim() == 0 and not isinstance(sigma, Tensor) else t


def _flow_coefficients(path: str, s: Tensor):
    """``(t, alpha, sigma_t, d_alpha, d_sigma_t)`` at EDM noise level ``s`` (float64 [B]): the
    path writes ``x_t = alpha x + sigma_t n`` with ``sigma_t / alpha = s``; the derivatives are
    with respect to the path's own ``t`` (module docstring, "Flow matching")."""
    t = flow_time(path, s)
    one = torch.ones_like(s)
    if path == "rectified_flow":
        return t, 1 / (1 + s), s / (1 + s), -one, one
    if path == "sit_linear":
        return t, 1 / (1 + s), s / (1 + s), one, -one
    # sit_gvp: alpha = sin(pi t/2) = 1/sqrt(1+s^2), sigma_t = cos(pi t/2) = s/sqrt(1+s^2);
    # cosine: alpha = cos(pi t/2), sigma_t = sin(pi t/2), the same values at the same s.
    r = torch.sqrt(1 + s * s)
    a, st = 1 / r, s / r
    if path == "cosine":
        return t, a, st, -(math.pi / 2) * st, (math.pi / 2) * a
    return t, a, st, (math.pi / 2) * st, -(math.pi / 2) * a


class _Converter:
    """The EDM <-> network conversion, written with torch ops so it traces."""

    def __init__(self, parameterization: str, sigma_data: float, schedule: str,
                 beta_min: Optional[float], beta_max: Optional[float], T: int,
                 alphas_cumprod: Any, timestep: str, t_scale: Optional[float],
                 timestep_dtype: Optional[torch.dtype], device: torch.device):
        if parameterization not in _BY_NAME:
            raise ValueError(f"parameterization must be one of {PARAMETERIZATIONS}, got {parameterization!r}")
        self.p = parameterization
        self.row = _BY_NAME[parameterization]
        self.sigma_data = float(sigma_data)
        if self.sigma_data <= 0:
            raise ValueError(f"sigma_data must be > 0, got {sigma_data}")
        self.continuous = False
        self.log_sigmas: Optional[Tensor] = None
        self.t_scale: Optional[float] = None
        self.schedule = "alphas_cumprod" if alphas_cumprod is not None else schedule
        if self.row.family == "flow":
            given = [name for name, differs in (
                ("schedule", schedule != "linear"), ("beta_min", beta_min is not None),
                ("beta_max", beta_max is not None), ("T", T != 1000),
                ("alphas_cumprod", alphas_cumprod is not None), ("timestep", timestep != "nearest")) if differs]
            if given:
                raise ValueError(f"{', '.join(given)}: a VP schedule's options, not used by the flow-matching "
                                 f"parameterization {parameterization!r} (its path fixes the noise levels)")
            default_scale = 1000.0 if self.row.path == "rectified_flow" else 1.0
            self.t_scale = default_scale if t_scale is None else float(t_scale)
            if not (math.isfinite(self.t_scale) and self.t_scale > 0):
                raise ValueError(f"t_scale must be > 0, got {t_scale}")
            self.t_dtype = timestep_dtype or torch.float32
            return
        if self.row.family != "vp":
            return
        if timestep not in ("nearest", "interp"):
            raise ValueError(f"timestep must be 'nearest' or 'interp', got {timestep!r}")
        self.timestep = timestep
        if alphas_cumprod is not None:
            ab = torch.as_tensor(alphas_cumprod, dtype=torch.float64).flatten().cpu()
            if ab.numel() < 2 or not bool(((ab > 0) & (ab < 1)).all()) or not bool((ab[1:] < ab[:-1]).all()):
                raise ValueError("alphas_cumprod must be a strictly decreasing table of values in (0, 1)")
        elif schedule == "continuous":
            lo, hi = _DEFAULT_BETAS["continuous"]
            self.beta_min = lo if beta_min is None else float(beta_min)
            self.beta_d = (hi if beta_max is None else float(beta_max)) - self.beta_min
            if self.beta_min < 0 or self.beta_d <= 0:
                raise ValueError(f"need 0 <= beta_min < beta_max, got {beta_min}, {beta_max}")
            self.continuous = True
            self.t_scale = 999.0 if t_scale is None else float(t_scale)
            self.t_dtype = timestep_dtype or torch.float32
            return
        elif schedule in SCHEDULES:
            ab = vp_alphas_cumprod(schedule, beta_min, beta_max, T)
        else:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if t_scale is not None:
            raise ValueError("t_scale applies to schedule='continuous' and to the flow-matching "
                             "parameterizations only")
        self.alphas_cumprod = ab
        self.log_sigmas = (0.5 * torch.log((1 - ab) / ab)).to(device)  # ascending
        default_dtype = torch.int64 if timestep == "nearest" else torch.float32
        self.t_dtype = timestep_dtype or default_dtype

    # -- sigma -> network time -------------------------------------------------------------------
    def time(self, sigma: Tensor) -> Tensor:
        """sigma [B] float32 -> the time argument the VP network expects, [B]."""
        s = sigma.to(torch.float64)
        if self.continuous:
            t = (torch.sqrt(self.beta_min ** 2 + 2 * self.beta_d * torch.log1p(s * s)) - self.beta_min) / self.beta_d
            return (t * self.t_scale).to(self.t_dtype)
        ls = torch.log(s)
        # A graph constant: it follows the load device (torch.jit.load(map_location=...) /
        # tch CModule::load_on_device), not a later module.to(device).
        table = self.log_sigmas
        assert table is not None
        if self.timestep == "nearest":
            idx = torch.argmin(torch.abs(ls.unsqueeze(1) - table.unsqueeze(0)), dim=1)
            return idx.to(self.t_dtype)
        n = table.shape[0]
        hi = torch.searchsorted(table, ls.contiguous()).clamp(1, n - 1)
        lo = hi - 1
        w = (ls - table[lo]) / (table[hi] - table[lo])
        t = (lo.to(torch.float64) + w).clamp(0, n - 1)
        return t.to(self.t_dtype)

    def note(self) -> dict:
        """What the file's note records of the conversion: family, path, prediction, time scale."""
        row = self.row
        out: dict = {"family": row.family, "path": row.path, "prediction": row.prediction}
        if row.family == "vp":
            out["schedule"] = self.schedule
        if row.family == "flow" or self.continuous:
            out["t_scale"] = self.t_scale
        return out

    # -- the whole conversion --------------------------------------------------------------------
    def denoise(self, net_call, x: Tensor, sigma: Tensor) -> Tensor:
        sig = sigma.to(x.dtype).reshape(-1)
        s4 = sig.reshape(-1, 1, 1, 1)
        row = self.row
        if self.p == "edm":
            return _as_tensor(net_call(x, sig))
        if self.p == "edm_raw":
            sd = self.sigma_data
            c_skip = sd * sd / (s4 * s4 + sd * sd)
            c_out = s4 * sd / torch.sqrt(s4 * s4 + sd * sd)
            c_in = 1 / torch.sqrt(s4 * s4 + sd * sd)
            c_noise = torch.log(sig) / 4
            return c_skip * x + c_out * _as_tensor(net_call(c_in * x, c_noise))
        if row.family == "flow":
            # x_t = alpha (x + sigma n) with sigma_t = alpha sigma (module docstring, "Flow matching").
            assert row.path is not None and self.t_scale is not None
            t, a, st, da, dst = (c.reshape(-1, 1, 1, 1) for c in _flow_coefficients(row.path, sig.to(torch.float64)))
            x_net = x * a.to(x.dtype)
            out = _as_tensor(net_call(x_net, (t.reshape(-1) * self.t_scale).to(self.t_dtype)))
            if row.prediction == "velocity":
                # u = da x + dst n and x_t = a x + st n give x = (st u - dst x_t) / (da st - a dst).
                det = da * st - a * dst
                return (-dst * a / det).to(x.dtype) * x + (st / det).to(x.dtype) * out
            if row.prediction == "noise":
                return x - s4 * out
            if row.prediction == "score":  # score = -n / sigma_t, so n = -sigma_t * score
                return x + (s4 * st.to(x.dtype)) * out
            raise ExportError(f"no conversion for the flow prediction {row.prediction!r}")
        x_vp = x / torch.sqrt(1 + s4 * s4)
        out = _as_tensor(net_call(x_vp, self.time(sig)))
        if self.p == "eps":
            return x - s4 * out
        if self.p == "v":
            return x / (1 + s4 * s4) - s4 / torch.sqrt(1 + s4 * s4) * out
        if self.p == "x0":
            return out
        raise ExportError(f"no conversion for the parameterization {self.p!r}")


def _as_tensor(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    sample = getattr(out, "sample", None)
    if isinstance(sample, Tensor):
        return sample
    raise ExportError(f"the network returned {type(out).__name__}; expected a Tensor, a tuple whose "
                      "first item is a Tensor, or an object with a .sample Tensor")


def _example_inputs(shape: Sequence[int], batch: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape
    # Noise levels across the useful range, spread differently for the trace and the check.
    if batch == 2:
        sigma = torch.tensor([0.35, 3.0])
    else:
        base = torch.tensor([0.02, 0.6, 18.0, 0.1, 2.5, 60.0, 0.005, 7.0])
        sigma = base.repeat(batch // base.numel() + 1)[:batch]
    x0 = 0.5 * torch.randn(batch, c, h, w, generator=g).clamp(-2, 2)
    x = x0 + sigma.reshape(-1, 1, 1, 1) * torch.randn(batch, c, h, w, generator=g)
    return x.to(device), sigma.to(device)


def _parse_shape(example_shape) -> tuple:
    if example_shape is None:
        raise ValueError("example_shape is required: (C,H,W) or (B,C,H,W) of one input image batch")
    shape = tuple(int(v) for v in example_shape)
    if len(shape) == 4:
        shape = shape[1:]
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"example_shape must be (C,H,W) or (B,C,H,W), got {example_shape!r}")
    return shape


def _atomic_tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _non_persistent_buffers(net: nn.Module) -> list:
    """Dotted names of the buffers registered with ``persistent=False``."""
    names = []
    for prefix, mod in net.named_modules():
        for b in sorted(getattr(mod, "_non_persistent_buffers_set", ())):
            if mod._buffers.get(b) is not None:
                names.append(f"{prefix}.{b}" if prefix else b)
    return names


# ---------------------------------------------------------------------------------------------
# Conditions held fixed (module docstring, "Conditional networks")
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Choosing the feature layer (module docstring)
# ---------------------------------------------------------------------------------------------

def _block_lists(module: nn.Module) -> list:
    """``(name, ModuleList)`` of every ModuleList whose last name component ends in ``blocks``."""
    return [(n, m) for n, m in module.named_modules()
            if n and isinstance(m, nn.ModuleList) and n.rsplit(".", 1)[-1].endswith("blocks") and len(m) > 0]


def suggest_feature_layer(module: nn.Module) -> Optional[str]:
    """The suggested feature layer: ``mid_block`` (a U-Net's bottleneck) if ``module`` has one,
    else the middle block, index ``(n-1)//2``, of the longest ModuleList named like ``*blocks``
    (the first of the longest; ``transformer_blocks.13`` of a 28-block DiT/SiT: block 14 of 28,
    the ICR paper's choice for SiT-XL/2). None when there is neither."""
    if dict(module.named_modules()).get("mid_block") is not None:
        return "mid_block"
    lists = _block_lists(module)
    if not lists:
        return None
    name, blocks = max(lists, key=lambda p: len(p[1]))  # max keeps the first of equals
    return f"{name}.{(len(blocks) - 1) // 2}"


def layer_marks(module: nn.Module) -> dict:
    """``{name: mark}`` for ``--list-layers``: ``middle of N`` on the middle block of each
    ModuleList of blocks (of at least 2), ``U-Net middle block`` on ``mid_block``, and
    ``suggested`` on :func:`suggest_feature_layer`'s choice."""
    marks: dict = {}
    for name, blocks in _block_lists(module):
        if len(blocks) >= 2:
            marks.setdefault(f"{name}.{(len(blocks) - 1) // 2}", []).append(f"middle of {len(blocks)}")
    if dict(module.named_modules()).get("mid_block") is not None:
        marks.setdefault("mid_block", []).append("U-Net middle block")
    best = suggest_feature_layer(module)
    if best is not None:
        marks.setdefault(best, []).append("suggested")
    return {k: ", ".join(v) for k, v in marks.items()}


# ---------------------------------------------------------------------------------------------
# Device independence (module docstring)
# ---------------------------------------------------------------------------------------------

def _method_graphs(script_module) -> list:
    """``(name, graph)`` of every method of a ScriptModule and of all its submodules, ``name``
    being ``forward`` or ``time_proj.forward`` (dotted submodule path). Submodules of one class
    type share their method graphs: each graph is listed once."""
    out, seen = [], set()
    for prefix, mod in script_module.named_modules():
        c = mod._c
        type_name = c._type().qualified_name()
        for meth in c._method_names():
            if (type_name, meth) in seen:
                continue
            seen.add((type_name, meth))
            out.append((f"{prefix}.{meth}" if prefix else meth, c._get_method(meth).graph))
    return out


def _nodes(block):
    """Every node of a graph or block, nested blocks (``prim::If``, ``prim::Loop``) included."""
    for n in block.nodes():
        yield n
        for b in n.blocks():
            yield from _nodes(b)


def _is_device_constant(node) -> bool:
    return node.kind() == "prim::Constant" and node.output().type().kind() == "DeviceObjType"


def _where(node) -> str:
    """The first line of a node's source range: the Python line it was traced from."""
    lines = [ln.strip() for ln in str(node.sourceRange()).splitlines() if ln.strip()]
    return lines[0] if lines else "(no source range)"


def _describe(method: str, const) -> list:
    device = str(const.output().toIValue())
    users = [u.user for u in const.output().uses()]
    if not users:
        return [{"device": device, "op": "(unused)", "method": method, "where": _where(const)}]
    return [{"device": device, "op": u.kind(), "method": method, "where": _where(u)} for u in users]


def device_constants(script_module) -> list:
    """The device constants (``prim::Constant`` of type ``Device``) in every method graph of a
    TorchScript module and of all its submodules, nested blocks included: one dict per use,
    ``{"device": "cpu", "op": "aten::ones", "method": "forward", "where": "unet_2d.py(285): forward"}``
    (``method`` is dotted by submodule, ``where`` is the source line of the op). ``script_module``
    is a loaded ``torch.jit.ScriptModule`` or the path of a TorchScript file (loaded on the CPU).
    An empty list means the file runs on whatever device its inputs are on."""
    if isinstance(script_module, (str, os.PathLike)):
        script_module = torch.jit.load(str(script_module), map_location="cpu")
    found = []
    for method, graph in _method_graphs(script_module):
        for n in _nodes(graph):
            if _is_device_constant(n):
                found.extend(_describe(method, n))
    return found


def _format_pins(pins: list) -> str:
    return "; ".join(f"{p['op']} pins device {p['device']!r} in {p['method']} ({p['where']})" for p in pins)


def _make_device_independent(script_module) -> int:
    """Replace every device constant of every method graph by ``prim::device`` of that graph's
    first tensor input (inserted at the start of the graph, so it dominates nested blocks too).
    Returns the number of constants replaced; raises ExportError for a graph without a tensor
    input."""
    replaced = 0
    for method, graph in _method_graphs(script_module):
        consts = [n for n in _nodes(graph) if _is_device_constant(n)]
        if not consts:
            continue
        # inputs()[0] is `self` (a module type); Optional[Tensor] or scalar inputs do not count.
        source = next((v for v in graph.inputs() if v.type().kind() == "TensorType"), None)
        if source is None:
            pins = [p for n in consts for p in _describe(method, n)]
            raise ExportError(f"cannot make the export device-independent: {_format_pins(pins)}, and "
                              f"{method} takes no tensor input whose device could replace it; create the "
                              "tensor on the device of an input tensor (device=x.device) in a method that has one")
        device = graph.create("prim::device", [source], 1)
        device.output().setType(torch._C.DeviceObjType.get())
        device.insertBefore(next(iter(graph.nodes())))
        for n in consts:
            n.output().replaceAllUsesWith(device.output())
            n.destroy()
            replaced += 1
    return replaced


# ---------------------------------------------------------------------------------------------
# Checks of the stated parameterization (module docstring, "What a wrong parameterization does")
# ---------------------------------------------------------------------------------------------

_DIFFUSERS_PREDICTIONS = {"epsilon": "eps", "v_prediction": "v", "sample": "x0"}
_DIFFUSERS_SCHEDULES = {"linear": "linear", "scaled_linear": "scaled_linear", "squaredcos_cap_v2": "cosine"}


def read_scheduler_config(scheduler) -> dict:
    """A diffusers scheduler's config: ``scheduler`` is a dict, a ``scheduler_config.json`` or a
    folder holding one (a pipeline's ``scheduler/``). Read as JSON (at most 1 MiB), never run."""
    if isinstance(scheduler, dict):
        return scheduler
    path = Path(scheduler)
    if path.is_dir():
        path = path / "scheduler_config.json"
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20)
        cfg = json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the scheduler config {path}: {e}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("_class_name"), str):
        raise ValueError(f"{path} is not a diffusers scheduler config (no _class_name)")
    return cfg


def scheduler_mismatches(cfg: dict, conv: "_Converter", schedule: str, beta_min: Optional[float],
                         beta_max: Optional[float], T: int) -> list:
    """What in the export disagrees with the diffusers scheduler config ``cfg`` (sentences; empty
    when it agrees). A ``FlowMatch*`` scheduler trains a rectified-flow network (its ``shift`` is
    the sampler's and is not compared); DDPM-style schedulers name the prediction, the schedule,
    its betas and the number of timesteps."""
    cls = cfg.get("_class_name", "?")
    p = conv.p
    if cls.startswith("FlowMatch"):
        if p != "rectified_flow":
            return [f"{cls} trains a rectified-flow network (x_t = (1-t) x + t n, predicting n - x): "
                    f"--parameterization rectified_flow, not {p}"]
        return []
    if cls.startswith("EDM"):  # EDMEulerScheduler, EDMDPMSolverMultistepScheduler: Karras et al.'s sigmas
        if conv.row.family != "edm":
            return [f"{cls} trains an EDM network: --parameterization edm or edm_raw, not {p}"]
        return []
    prediction = cfg.get("prediction_type", "epsilon")
    if "beta_schedule" not in cfg and "prediction_type" not in cfg:
        return [f"{cls} is not a scheduler the exporter knows (a FlowMatch* or a DDPM-style scheduler "
                "with prediction_type and beta_schedule)"]
    want = _DIFFUSERS_PREDICTIONS.get(prediction)
    if want is None:
        return [f"{cls} has prediction_type {prediction!r}, which no parameterization matches"]
    if p != want:
        return [f"{cls} with prediction_type {prediction!r} is --parameterization {want}, not {p}"]
    out = []
    sched = _DIFFUSERS_SCHEDULES.get(cfg.get("beta_schedule", "linear"))
    if sched is None:
        out.append(f"{cls} has beta_schedule {cfg.get('beta_schedule')!r}, which no --schedule matches "
                   "(pass its alphas_cumprod table to export(alphas_cumprod=...))")
    elif schedule != sched:
        out.append(f"{cls} has beta_schedule {cfg.get('beta_schedule')!r}: --schedule {sched}, not {schedule}")
    if sched in ("linear", "scaled_linear") and schedule == sched:
        lo, hi = _DEFAULT_BETAS[sched]
        for key, ours, default in (("beta_start", beta_min, lo), ("beta_end", beta_max, hi)):
            theirs = cfg.get(key)
            mine = default if ours is None else ours
            if theirs is not None and not math.isclose(float(theirs), mine, rel_tol=1e-9):
                flag = "--beta-min" if key == "beta_start" else "--beta-max"
                out.append(f"{cls} has {key} {theirs}: {flag} {theirs}, not {mine}")
    n = cfg.get("num_train_timesteps")
    if n is not None and int(n) != T:
        out.append(f"{cls} has num_train_timesteps {n}: --T {n}, not {T}")
    return out


def scheduler_round_trip(cfg: dict, conv: "_Converter") -> Optional[str]:
    """The noisy input the export hands the network, against the one the diffusers scheduler
    makes from the same image and noise (``add_noise``, or ``scale_noise`` for ``FlowMatch*``), at
    four of its timesteps: a sentence when they differ, None when they agree or when diffusers (or
    the scheduler class) is not importable."""
    try:
        import diffusers
        sched = getattr(diffusers, cfg["_class_name"]).from_config(cfg)
    except Exception:
        return None
    if conv.row.family == "edm":
        return None  # an EDM network takes sigma itself: nothing to map
    g = torch.Generator().manual_seed(3)
    x0 = torch.rand(1, 2, 4, 4, generator=g, dtype=torch.float64) * 2 - 1
    n = torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64)
    worst = 0.0
    with torch.no_grad():
        if conv.row.family == "flow" and hasattr(sched, "scale_noise"):
            n_steps = len(sched.timesteps)  # index 0 is t = 1, all noise: sigma infinite
            steps = sched.timesteps[[n_steps * k // 8 for k in (1, 3, 5, 7)]]
            for tau in steps:
                s = float(tau) / float(sched.config.num_train_timesteps)  # the scheduler's t
                theirs = sched.scale_noise(x0, tau.reshape(1), n)
                sigma = torch.tensor([s / (1 - s)], dtype=torch.float64)
                t, a, _, _, _ = _flow_coefficients(conv.row.path, sigma)
                worst = max(worst, float((a * (x0 + sigma * n) - theirs).abs().max()), abs(float(t) - s))
        elif conv.log_sigmas is not None and hasattr(sched, "add_noise") and hasattr(sched, "alphas_cumprod"):
            ab = sched.alphas_cumprod.to(torch.float64)
            for k in torch.linspace(0, len(ab) - 1, 4).long():
                theirs = sched.add_noise(x0, n, k.reshape(1))
                sigma = torch.sqrt((1 - ab[k]) / ab[k]).reshape(1)
                ours = (x0 + sigma * n) / torch.sqrt(1 + sigma * sigma)
                step = float(conv.time(sigma.to(torch.float32)))
                worst = max(worst, float((ours - theirs).abs().max()), abs(step - float(k)))
        else:
            return (f"the export's {conv.row.family} conversion cannot be compared with a "
                    f"{cfg['_class_name']}: the family differs")
    if worst > 1e-3:
        return (f"the network input the export makes differs from the {cfg['_class_name']}'s own noising "
                f"by {worst:.3g}: the schedule or the timesteps do not match")
    return None


def consistency_warning(denoise, shape, device="cpu", sigma_max: float = 80.0) -> Optional[str]:
    """A warning when the denoiser ``denoise(x, sigma) -> (denoised, features)`` does not behave
    as a trained denoiser at high noise: from pure noise (a zero image plus noise) at two high
    noise levels, ``s`` = min(80, 0.9 ``sigma_max``) and ``s / 4`` (``sigma_max``: the highest
    level the network was trained at, a discrete VP schedule's last), a trained denoiser returns
    about the mean of its data at both (a root mean square of the order of the data's), while a
    network converted with the wrong parameterization returns values that grow with sigma.
    Meaningful for a trained network only (an untrained one grows too); None when nothing is
    wrong that this can see."""
    c, h, w = shape
    n = torch.randn(4, c, h, w, generator=torch.Generator().manual_seed(2)).to(device)
    hi = min(80.0, 0.9 * float(sigma_max))
    levels = (hi / 4, hi)
    rms = []
    with torch.no_grad():
        for s in levels:
            d = denoise(s * n, torch.full((4,), s, device=device))[0]
            rms.append(float(d.double().pow(2).mean().sqrt()))
    if rms[1] > 4.0 and rms[1] > 2.0 * rms[0]:
        return (f"the denoised output from pure noise has root mean square {rms[0]:.3g} at sigma {levels[0]:.3g} "
                f"and {rms[1]:.3g} at sigma {levels[1]:.3g}; a trained denoiser's stays near its data's mean at "
                "both. If the "
                "network is trained, its parameterization is probably not the one stated (a flow-matching "
                "network exported as eps/v/x0, or the other way round): name its training scheduler "
                "(--scheduler) to check")
    return None


# The TracerWarnings a trace filters, as (module, message) regular expressions matched from the
# start of the warning's module name and message (module docstring, "Tracer warnings").
_HARMLESS_TRACER_WARNINGS = (
    # torch.nn.functional's batch-size sanity checks (group_norm, ...).
    (r"torch\.nn\.functional", ""),
    # diffusers' checks of the channel count and the spatial size, and its .contiguous()
    # workarounds for large batches.
    (r"diffusers\.", r"Converting a tensor to a Python (boolean|integer)"),
)


@contextlib.contextmanager
def _quiet_trace():
    """The warnings filters of a trace: torch's deprecation notices about TorchScript (the
    contract: libtorch loads it) and :data:`_HARMLESS_TRACER_WARNINGS`; any other TracerWarning,
    one from the network's own code in particular, is shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit")
        for module, message in _HARMLESS_TRACER_WARNINGS:
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=module,
                                    message=message)
        yield


def export(module: nn.Module, feature_layer: str, path, parameterization: str = "edm",
           example_shape=None, sigma_data: float = 0.5, *, schedule: str = "linear",
           beta_min: Optional[float] = None, beta_max: Optional[float] = None, T: int = 1000,
           alphas_cumprod=None, timestep: str = "nearest", t_scale: Optional[float] = None,
           timestep_dtype: Optional[torch.dtype] = None, device="cpu", atol: float = 1e-5,
           check: bool = True, condition: Any = "auto", class_keyword: str = "class_labels",
           extra_conditions: Sequence[Embedding] = (), scheduler: Any = None,
           warn_inconsistent: bool = False, verbose: bool = True,
           compile: Optional[dict] = None) -> torch.jit.ScriptModule:
    """Wrap ``module`` into the diffmon model contract and save it as TorchScript at ``path``.

    Args:
        module: the network. It is not modified: a deep copy, moved to ``device`` (and cast to
            float32 when its parameters are not), is traced in eval mode.
        feature_layer: dotted name of the submodule whose output is the feature map.
        path: output file; written atomically (temporary name, checked, then renamed).
        parameterization: a name of :data:`PARAMETERIZATION_TABLE` (``edm``, ``edm_raw``, ``eps``,
            ``v``, ``x0``, ``rectified_flow``, ``sit_linear_velocity``, ...; module docstring).
        example_shape: ``(C,H,W)`` or ``(B,C,H,W)`` of the model input; any B is ignored: the
            trace is made with B=2 and checked with B=3, so the batch dimension is dynamic.
        sigma_data: EDM sigma_data (``edm_raw`` only).
        schedule, beta_min, beta_max, T, alphas_cumprod, timestep, t_scale, timestep_dtype:
            the VP noise schedule for ``eps``/``v``/``x0`` (see module docstring); ``t_scale``
            and ``timestep_dtype`` also set the time of a flow-matching network.
        device: where the trace is made (and where the saved constants live); default CPU.
        atol: largest allowed max-abs difference between the reloaded file and the eager
            module, on both outputs.
        check: reload and compare (on by default).
        condition: what the network gets besides (x, t), held fixed (module docstring,
            "Conditional networks"): ``"auto"`` (default: the null class if the module is
            class-conditional, else nothing), ``None`` (nothing), ``"null"`` (the null class, see
            :func:`null_class`), a class index ``int``, or an :class:`Embedding`.
        class_keyword: the keyword the class labels are passed as (``class_labels``, diffusers').
        extra_conditions: further :class:`Embedding` s held fixed next to ``condition``, each
            passed as its own keyword (SD3's ``pooled_projections``: ``Embedding(t,
            "pooled_projections", pooled=True)``).
        scheduler: the diffusers scheduler the network was trained with (a config dict, a
            ``scheduler_config.json`` or its folder): the export is checked against it and a
            mismatch is an :class:`ExportError` (module docstring, "What a wrong parameterization
            does").
        warn_inconsistent: print a warning when the exported denoiser does not behave as a
            trained one at high noise (:func:`consistency_warning`); for trained weights only.
        verbose: print the condition applied (one line), if any.
        compile: also compile the same wrapper into an AOTInductor package beside ``path``: the
            keywords of :func:`diffmon.compile.compile_contract` (``device`` must be this
            export's; ``{}`` for the defaults). ``None`` (default): TorchScript only.

    Returns the reloaded ``torch.jit.ScriptModule``.
    Raises ValueError for bad arguments and ExportError when tracing fails or the check differs.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    shape = _parse_shape(example_shape)
    device = torch.device(device)
    path = Path(path)
    conv = _Converter(parameterization, sigma_data, schedule, beta_min, beta_max, T, alphas_cumprod,
                      timestep, t_scale, timestep_dtype, device)
    if not feature_layer:
        raise ValueError("feature_layer must name a submodule (not the whole module)")
    sched_cfg = read_scheduler_config(scheduler) if scheduler is not None else None
    if sched_cfg is not None:
        wrong = scheduler_mismatches(sched_cfg, conv, schedule, beta_min, beta_max, T)
        wrong = wrong or list(filter(None, [scheduler_round_trip(sched_cfg, conv)]))
        if wrong:
            raise ExportError("the export disagrees with the training scheduler: " + "; ".join(wrong))
    cond = _fixed_inputs(module, _resolve_condition(module, condition, class_keyword), extra_conditions).to(device)
    time_keyword = _time_keyword(module)
    names = dict(module.named_modules())
    if feature_layer not in names:
        listing = ", ".join(n for n in names if n) or "(none)"
        raise ValueError(f"feature_layer {feature_layer!r} is not a submodule of {type(module).__name__}; "
                         f"submodules: {listing}")

    try:
        net = copy.deepcopy(module)
    except Exception as e:  # pragma: no cover - exotic modules
        raise ExportError(f"cannot deep-copy the module for tracing: {e}") from e
    net = net.to(device).eval()
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in net.parameters()):
        net = net.float()  # half / bfloat16 / double weights: the contract is float32
    for p in net.parameters():
        p.requires_grad_(False)

    captured: list = []

    def hook(_mod, _inp, out):
        if isinstance(out, (tuple, list)):
            # A joint (MMDiT) block of SD3/Flux returns (encoder_hidden_states, hidden_states):
            # the image tokens are its last tensor.
            tensors = [o for o in out if isinstance(o, Tensor)]
            out = tensors[-1] if tensors else out
        captured.append(out.clone() if isinstance(out, Tensor) else out)

    layer = net.get_submodule(feature_layer)
    handle = layer.register_forward_hook(hook)
    inner_forward = type(net).forward

    channels = shape[0]
    learned_sigma: list = []  # set by the eager run before the trace

    def net_call(a, b):
        if time_keyword is None:
            out = _as_tensor(inner_forward(net, a, b, **cond.kwargs(a, b)))
        else:
            out = _as_tensor(inner_forward(net, a, **{time_keyword: b}, **cond.kwargs(a, b)))
        if not torch.jit.is_tracing():
            learned_sigma[:] = [out.dim() == 4 and out.shape[1] == 2 * channels]
        if learned_sigma[0]:
            out = out[:, :channels]  # learned sigma: the first C channels are the prediction
        return out

    def contract_forward(x: Tensor, sigma: Tensor):
        captured.clear()
        denoised = conv.denoise(net_call, x, sigma)
        if len(captured) != 1:
            raise ExportError(f"feature layer {feature_layer!r} ran {len(captured)} times in one forward; "
                              "it must run exactly once")
        feats = captured[0]
        captured.clear()
        if not isinstance(feats, Tensor):
            raise ExportError(f"feature layer {feature_layer!r} returned {type(feats).__name__}, not a Tensor")
        if feats.dim() == 3:
            feats = feats.mean(dim=1)
        if not torch.jit.is_tracing():  # checked eagerly before the trace and after it
            if feats.dim() not in (2, 4) or feats.shape[0] != x.shape[0]:
                raise ExportError(f"feature layer {feature_layer!r} output has shape {tuple(feats.shape)}; "
                                  "expected [B,C,H,W], [B,d] or [B,L,d]")
            if denoised.shape != x.shape:
                raise ExportError(f"denoised output has shape {tuple(denoised.shape)}, input {tuple(x.shape)} "
                                  "(a network output of 2*C channels is taken as learned sigma; any other "
                                  "mismatch is an error)")
        return denoised.to(torch.float32), feats.to(torch.float32)

    # Tracing `net` itself (with an instance-level forward) keeps its parameter names unprefixed.
    net.forward = contract_forward
    if verbose and cond.line:
        print(cond.line)
    x2, s2 = _example_inputs(shape, 2, 0, device)
    try:
        with torch.no_grad():
            contract_forward(x2, s2)  # eager first: the module's own errors, not the tracer's
    except ExportError:
        handle.remove()
        raise
    except Exception as e:
        handle.remove()
        given = ", ".join(["x", f"{time_keyword}=t" if time_keyword else "t"]
                          + [f"{k}=..." for k in cond.kwargs(x2, s2)])
        raise ExportError(f"{type(module).__name__} failed when called as forward({given}): "
                          f"{type(e).__name__}: {e}; " + _WRAPPER_HINT) from e
    try:
        with torch.no_grad(), _quiet_trace():
            traced = torch.jit.trace(net, (x2, s2), check_trace=False)
    except ExportError:
        handle.remove()
        raise
    except Exception as e:
        handle.remove()
        raise ExportError(f"torch.jit.trace failed: {e}") from e

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _atomic_tmp(path)
    try:
        # The trace's device constants become the input's device (module docstring).
        _make_device_independent(traced)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit")
            # Non-persistent buffers are part of the module but never of a state_dict(): the
            # note tells diffmon not to expect them in checkpoints (they keep these values).
            note = {"non_persistent_buffers": _non_persistent_buffers(net),
                    "device_independent": True, "torch": torch.__version__,
                    "input_shape": [int(d) for d in shape],
                    "feature_layer": feature_layer, "parameterization": parameterization,
                    "learned_sigma": bool(learned_sigma[0]), "condition": cond.note, **conv.note()}
            torch.jit.save(traced, str(tmp), _extra_files={"diffmon.json": json.dumps(note)})
            loaded = torch.jit.load(str(tmp), map_location=device)
        pins = device_constants(loaded)
        if pins:
            raise ExportError(f"the exported file is not device-independent: {_format_pins(pins)}; it "
                              "would fail on any other device")
        if check:
            x3, s3 = _example_inputs(shape, 3, 1, device)
            with torch.no_grad():
                want_d, want_f = contract_forward(x3, s3)
                try:
                    got = loaded(x3, s3)
                except Exception as e:
                    raise ExportError(f"the exported file fails at batch 3 (the trace used batch 2): {e}") from e
            if not (isinstance(got, tuple) and len(got) == 2):
                raise ExportError("the exported forward does not return (denoised, features)")
            for what, a, b in (("denoised", got[0], want_d), ("features", got[1], want_f)):
                if a.shape != b.shape:
                    raise ExportError(f"exported {what} has shape {tuple(a.shape)} at batch 3, eager "
                                      f"{tuple(b.shape)}: the batch dimension is not dynamic")
                diff = float((a - b).abs().max()) if a.numel() else 0.0
                if not diff <= atol:
                    raise ExportError(f"exported {what} differs from the eager module by {diff:.3g} "
                                      f"(> {atol:g}) at batch 3: data- or shape-dependent control flow "
                                      "was probably frozen by tracing")
        if warn_inconsistent:
            top = float(conv.log_sigmas[-1].exp()) if conv.log_sigmas is not None else 80.0
            warning = consistency_warning(loaded, shape, device, sigma_max=top)
            if warning:
                print(f"warning: {warning}", file=sys.stderr)
        os.replace(tmp, path)
        if compile is not None:
            _compile(net, path, shape, device, compile)
    finally:
        handle.remove()
        if tmp.exists():
            tmp.unlink()
    return loaded


def _compile(net: nn.Module, path: Path, shape, device: torch.device, options: dict) -> None:
    """The compiled package beside the TorchScript file (diffmon/compile.py)."""
    from .compile import compile_contract

    options = dict(options)
    if torch.device(options.pop("device", device)) != device:
        raise ValueError("compile: the package is compiled on the export's device; pass device= "
                         "to export() as well")
    try:
        compile_contract(net, path, shape, device, **options)
    except (ValueError, ExportError):
        raise
    except Exception as e:
        raise ExportError(f"{path} written; compiling it with AOTInductor failed: {e}") from e


def _posterior_mean(out: Any) -> Tensor:
    """The posterior mean of an ``encode`` result: ``.latent_dist.mean`` (diffusers'
    ``DiagonalGaussianDistribution``), or its ``mode()``."""
    dist = getattr(out, "latent_dist", None)
    if dist is None and isinstance(out, (tuple, list)) and out:
        dist = out[0]
    mean = getattr(dist, "mean", None)
    if isinstance(mean, Tensor):
        return mean
    mode = getattr(dist, "mode", None)
    if callable(mode):
        return mode()
    raise ExportError(f"encode(x) returned {type(out).__name__}; expected an object whose .latent_dist "
                      "has a .mean tensor (diffusers' AutoencoderKLOutput)")


def _config_value(vae: nn.Module, key: str):
    config = getattr(vae, "config", None)
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)


def export_vae(vae: nn.Module, path, example_shape, scaling_factor: Optional[float] = None,
               shift_factor: Optional[float] = None, device="cpu", *, atol: float = 1e-5,
               check: bool = True) -> torch.jit.ScriptModule:
    """Export a VAE (diffusers ``AutoencoderKL`` or anything with its ``encode(x).latent_dist`` /
    ``decode(z).sample`` interface) to one TorchScript file with the methods ``encode`` (=
    ``forward``) and ``decode`` (module docstring, "The VAE file").

    Args:
        vae: the autoencoder; not modified (a float32 deep copy is traced in eval mode).
        path: output file; written atomically.
        example_shape: ``(C,H,W)`` or ``(B,C,H,W)`` of the images (any B is ignored).
        scaling_factor, shift_factor: the latent scaling, ``z = (mean - shift) * scale``; default
            ``vae.config.scaling_factor`` / ``vae.config.shift_factor`` (missing or None: 1.0 / 0.0).
        device: where the trace is made; atol, check: as for :func:`export` (both methods).

    Returns the reloaded ``torch.jit.ScriptModule``.
    """
    if not isinstance(vae, nn.Module):
        raise TypeError(f"vae must be a torch.nn.Module, got {type(vae).__name__}")
    for meth in ("encode", "decode"):
        if not callable(getattr(vae, meth, None)):
            raise ValueError(f"{type(vae).__name__} has no {meth}() method: not a VAE")
    shape = _parse_shape(example_shape)
    device = torch.device(device)
    path = Path(path)
    if scaling_factor is None:
        scaling_factor = _config_value(vae, "scaling_factor")
    if shift_factor is None:
        shift_factor = _config_value(vae, "shift_factor")
    scale = 1.0 if scaling_factor is None else float(scaling_factor)
    shift = 0.0 if shift_factor is None else float(shift_factor)
    if not (math.isfinite(scale) and scale != 0 and math.isfinite(shift)):
        raise ValueError(f"need a finite non-zero scaling_factor and a finite shift_factor, got {scale}, {shift}")

    try:
        net = copy.deepcopy(vae)
    except Exception as e:  # pragma: no cover - exotic modules
        raise ExportError(f"cannot deep-copy the VAE for tracing: {e}") from e
    net = net.to(device).eval()
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in net.parameters()):
        net = net.float()
    for p in net.parameters():
        p.requires_grad_(False)
    enc, dec = type(net).encode, type(net).decode

    def encode(x: Tensor) -> Tensor:
        return ((_posterior_mean(enc(net, x)) - shift) * scale).to(torch.float32)

    def decode(z: Tensor) -> Tensor:
        return _as_tensor(dec(net, z / scale + shift)).to(torch.float32)

    def forward(x: Tensor) -> Tensor:
        return encode(x)

    # Instance attributes: the traced file's parameter names stay those of vae.state_dict().
    net.encode, net.decode, net.forward = encode, decode, forward
    g = torch.Generator().manual_seed(0)
    c, h, w = shape
    x2 = (torch.rand(2, c, h, w, generator=g) * 2 - 1).to(device)
    x3 = (torch.rand(3, c, h, w, generator=g) * 2 - 1).to(device)
    with torch.no_grad():
        z2 = encode(x2)
        if z2.dim() != 4 or z2.shape[0] != 2:
            raise ExportError(f"encode returned shape {tuple(z2.shape)} for {tuple(x2.shape)}; expected [B,c,h,w]")
        back = decode(z2)
        if back.shape != x2.shape:
            raise ExportError(f"decode returned shape {tuple(back.shape)} for latents {tuple(z2.shape)}; "
                              f"expected {tuple(x2.shape)}")
    try:
        with torch.no_grad(), _quiet_trace():
            traced = torch.jit.trace_module(net, {"forward": (x2,), "encode": (x2,), "decode": (z2,)},
                                            check_trace=False)
    except Exception as e:
        raise ExportError(f"torch.jit.trace_module failed: {e}") from e

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _atomic_tmp(path)
    try:
        _make_device_independent(traced)
        note = {"kind": "vae", "scaling_factor": scale, "shift_factor": shift, "encode": "posterior mean",
                "image_shape": list(shape), "latent_shape": list(z2.shape[1:]),
                "non_persistent_buffers": _non_persistent_buffers(net),
                "device_independent": True, "torch": torch.__version__}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit")
            torch.jit.save(traced, str(tmp), _extra_files={"diffmon.json": json.dumps(note)})
            loaded = torch.jit.load(str(tmp), map_location=device)
        pins = device_constants(loaded)
        if pins:
            raise ExportError(f"the exported file is not device-independent: {_format_pins(pins)}; it "
                              "would fail on any other device")
        if check:
            with torch.no_grad():
                z3 = encode(x3)
                checks = (("encode", lambda: loaded.encode(x3), z3), ("forward", lambda: loaded(x3), z3),
                          ("decode", lambda: loaded.decode(z3), decode(z3)))
                for what, run, want in checks:
                    try:
                        got = run()
                    except Exception as e:
                        raise ExportError(f"the exported {what} fails at batch 3 (the trace used batch 2): {e}") from e
                    if got.shape != want.shape:
                        raise ExportError(f"exported {what} has shape {tuple(got.shape)} at batch 3, eager "
                                          f"{tuple(want.shape)}: the batch dimension is not dynamic")
                    diff = float((got - want).abs().max()) if got.numel() else 0.0
                    if not diff <= atol:
                        raise ExportError(f"exported {what} differs from the eager VAE by {diff:.3g} "
                                          f"(> {atol:g}) at batch 3")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return loaded


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"--factory must look like package.module:callable, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _is_safetensors(path: str) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= os.path.getsize(path) - 8


def load_weights(path: str, key: Optional[str] = None, strip_prefix: str = "") -> dict:
    """The state_dict in ``path``: safetensors (detected by content) or a ``torch.save`` file read
    with ``weights_only=True``, optionally nested under ``key``, with ``strip_prefix`` removed."""
    if _is_safetensors(path):
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise SystemExit(f"{path} is a safetensors file: pip install safetensors") from e
        sd = load_file(path, device="cpu")
    else:
        # From an open file: torch.load would otherwise pick its reader by the file's extension.
        with open(path, "rb") as f:
            sd = torch.load(f, map_location="cpu", weights_only=True)
    if key:
        for part in key.split("."):
            sd = sd[part]
    if strip_prefix:
        sd = {k[len(strip_prefix):] if k.startswith(strip_prefix) else k: v for k, v in sd.items()}
    return sd


def _parameterization_lines() -> str:
    """The --help section listing :data:`PARAMETERIZATION_TABLE`, one line each."""
    width = max(len(p.name) for p in PARAMETERIZATION_TABLE)
    return "\n".join(f"  {p.name:<{width}}  {p.help}" for p in PARAMETERIZATION_TABLE)


_EPILOG_HEAD = """\
parameterizations (--parameterization; docs/guide/model-contract.md derives each conversion):
{table}
A timestep shift (SD3's shift, Flux's resolution-dependent shift) belongs to the sampler, not to
the network: it changes no option here.

"""

_EPILOG = """\
diffusers (a save_pretrained folder, e.g. a checkpoint-N/unet of train_unconditional.py):
  %(prog)s --factory diffusers:UNet2DModel.from_pretrained \\
      --factory-kwargs '{"pretrained_model_name_or_path": "run/checkpoint-500/unet"}' \\
      --feature-layer mid_block --shape 3 64 64 --out run/model.ts \\
      --parameterization eps --schedule linear --T 1000
A UNet trained with DDPMScheduler (prediction_type "epsilon", beta_schedule "linear",
num_train_timesteps 1000) is --parameterization eps --schedule linear --T 1000, with
--beta-min/--beta-max = the scheduler's beta_start/beta_end when not 1e-4/0.02
("v_prediction" is v, "sample" is x0; "scaled_linear" and "squaredcos_cap_v2" are
--schedule scaled_linear and cosine).

Conditional networks: the condition is held fixed in the file. A class-conditional network
(class_embedding, or a DiT's LabelEmbedding) gets its null class by default; --class-label N
fixes class N, --no-condition passes no label. A text-conditional UNet2DConditionModel:
  %(prog)s --factory diffusers:UNet2DConditionModel.from_pretrained \\
      --factory-kwargs '{"pretrained_model_name_or_path": "run/checkpoint-500/unet"}' \\
      --embedding empty_prompt.pt --feature-layer mid_block --shape 4 32 32 \\
      --out run/model.ts --parameterization eps --schedule scaled_linear
--list-layers marks the middle block of each list of blocks and the suggested layer.

A flow-matching SD3-style transformer (FlowMatchEulerDiscreteScheduler), held at the empty
prompt's embeddings, checked against its training scheduler:
  %(prog)s --factory diffusers:SD3Transformer2DModel.from_pretrained \\
      --factory-kwargs '{"pretrained_model_name_or_path": "run/checkpoint-500/transformer"}' \\
      --embedding empty_prompt.pt --pooled-embedding empty_pooled.pt \\
      --feature-layer transformer_blocks.11 --shape 16 32 32 --out run/model.ts \\
      --parameterization rectified_flow --scheduler run/scheduler

A VAE (AutoencoderKL), for latent models: one file with encode (posterior mean, scaled)
and decode:
  %(prog)s --vae --factory diffusers:AutoencoderKL.from_pretrained \\
      --factory-kwargs '{"pretrained_model_name_or_path": "models/sd/vae"}' \\
      --shape 3 256 256 --out vae.ts
"""

# Options of the denoiser export that --vae does not take (dest, flag).
_DENOISER_ONLY = (("feature_layer", "--feature-layer"), ("parameterization", "--parameterization"),
                  ("scheduler", "--scheduler"), ("pooled_embedding", "--pooled-embedding"),
                  ("pooled_embedding_key", "--pooled-embedding-key"),
                  ("sigma_data", "--sigma-data"), ("schedule", "--schedule"), ("beta_min", "--beta-min"),
                  ("beta_max", "--beta-max"), ("T", "--T"), ("timestep", "--timestep"),
                  ("t_scale", "--t-scale"), ("class_label", "--class-label"), ("null_class", "--null-class"),
                  ("no_condition", "--no-condition"), ("embedding", "--embedding"),
                  ("embedding_key", "--embedding-key"), ("embedding_keyword", "--embedding-keyword"),
                  ("class_keyword", "--class-keyword"))


def build_parser(prog: str = "python -m diffmon.export") -> argparse.ArgumentParser:
    """The command line of ``diffmon-export`` (every option has its help text)."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Export a PyTorch network to diffmon's TorchScript model contract "
                    "(forward(x, sigma) -> (EDM denoised, features)), or with --vae a VAE "
                    "(encode, decode).",
        epilog=_EPILOG_HEAD.format(table=_parameterization_lines()) + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factory", required=True,
                    help="module:callable returning the nn.Module (importable from the current folder); "
                         "dotted attributes after the colon are followed, e.g. "
                         "diffusers:UNet2DModel.from_pretrained")
    ap.add_argument("--factory-kwargs", default="{}", help="JSON object of keyword arguments for the factory")
    ap.add_argument("--weights", help="optional state_dict to load first: safetensors (detected by content) "
                                      "or a torch.save file (read with torch.load(weights_only=True))")
    ap.add_argument("--weights-key", help="key under which the state_dict is nested (e.g. ema, model; "
                                          "dots for deeper levels)")
    ap.add_argument("--strip-prefix", default="", help="key prefix to strip, e.g. module.")
    ap.add_argument("--list-layers", action="store_true",
                    help="print the submodule names (name<TAB>type[<TAB>(mark)]) and exit; the mark names "
                         "the middle block of each list of blocks, mid_block, and the suggested layer")
    ap.add_argument("--feature-layer", help="dotted submodule name of the feature layer")
    ap.add_argument("--shape", type=int, nargs=3, metavar=("C", "H", "W"), help="input image shape")
    ap.add_argument("--parameterization", choices=PARAMETERIZATIONS, metavar="NAME",
                    help="what the network computes, one of the parameterizations listed below "
                         "(default edm)")
    ap.add_argument("--sigma-data", type=float,
                    help="EDM's sigma_data, the data's standard deviation in edm_raw's c_skip, c_out, "
                         "c_in (default 0.5)")
    ap.add_argument("--scheduler", metavar="PATH",
                    help="the diffusers scheduler the network was trained with (scheduler_config.json "
                         "or its folder): the export is checked against it (prediction type, schedule, "
                         "betas, timesteps, a flow-matching scheduler) and refused if they disagree")
    vp = ap.add_argument_group("the network's time: a VP noise schedule (eps, v, x0); --t-scale also for flow matching")
    vp.add_argument("--schedule", choices=SCHEDULES,
                    help="linear (DDPM), scaled_linear (Stable Diffusion), cosine (squaredcos_cap_v2) "
                         "over --T discrete steps, or continuous: Song et al.'s VP SDE with beta(t) "
                         "linear in t in [0, 1] (default linear)")
    vp.add_argument("--beta-min", type=float,
                    help="first beta of the schedule (diffusers' beta_start); default 1e-4 linear, "
                         "0.00085 scaled_linear, 0.1 continuous (beta(0))")
    vp.add_argument("--beta-max", type=float,
                    help="last beta (diffusers' beta_end); default 0.02 linear, 0.012 scaled_linear, "
                         "20 continuous (beta(1))")
    vp.add_argument("--T", type=int, help="number of discrete timesteps, num_train_timesteps (default 1000)")
    vp.add_argument("--timestep", choices=("nearest", "interp"),
                    help="the time a discrete-schedule network gets: nearest, the int64 step whose noise "
                         "level is nearest to sigma; interp, a float32 fractional step, linear in "
                         "log sigma (for time embeddings that take non-integer steps); default nearest")
    vp.add_argument("--t-scale", type=float,
                    help="the network's time is t * T_SCALE: for --schedule continuous, t in [0, 1] "
                         "(default 999, as score_sde and EDM's VPPrecond); for rectified_flow the "
                         "path's t (default 1000, diffusers' SD3; 1 for Flux); for the SiT "
                         "parameterizations default 1")
    cond = ap.add_argument_group(
        "condition held fixed (default: the null class of a class-conditional network, else none)")
    one = cond.add_mutually_exclusive_group()
    one.add_argument("--class-label", type=int, metavar="N", help="pass class index N")
    one.add_argument("--null-class", action="store_true",
                     help="pass the null class (error if it cannot be found)")
    one.add_argument("--no-condition", action="store_true",
                     help="pass no class label, even to a class-conditional network")
    one.add_argument("--embedding", metavar="FILE",
                     help="pass this [L,D] or [1,L,D] tensor (torch.save or safetensors file), "
                          "expanded to the batch")
    cond.add_argument("--embedding-key", metavar="KEY", help="the tensor's key, if FILE holds several")
    cond.add_argument("--embedding-keyword", metavar="NAME",
                      help="keyword the embedding is passed as (default encoder_hidden_states)")
    cond.add_argument("--class-keyword", metavar="NAME", help="keyword of the class labels (default class_labels)")
    cond.add_argument("--pooled-embedding", metavar="FILE",
                      help="also pass this [D] or [1,D] tensor as pooled_projections (an SD3-style "
                           "transformer's pooled text embedding), expanded to the batch")
    cond.add_argument("--pooled-embedding-key", metavar="KEY",
                      help="the pooled tensor's key, if FILE holds several")
    vae = ap.add_argument_group("VAE export (--vae)")
    vae.add_argument("--vae", action="store_true",
                     help="export a VAE (encode: posterior mean, scaled; decode) instead of a denoiser")
    vae.add_argument("--scaling-factor", type=float, help="default the VAE's config.scaling_factor")
    vae.add_argument("--shift-factor", type=float, help="default the VAE's config.shift_factor, or 0")
    ap.add_argument("--out", help="output TorchScript file")
    from . import compile as compiling
    compiling.add_arguments(ap)
    return ap


def main(argv=None) -> int:
    from . import compile as compiling

    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    ap = build_parser(prog if prog.startswith("diffmon-export") else "python -m diffmon.export")
    args = ap.parse_args(argv)
    compile_options = compiling.options(args, sys.argv[1:] if argv is None else list(argv))
    if compile_options is not None and args.vae:
        ap.error("--compile: a denoiser only, not with --vae")

    if args.vae:
        given = [flag for dest, flag in _DENOISER_ONLY if getattr(args, dest) not in (None, False)]
        if given:
            ap.error(f"{', '.join(given)}: not used with --vae")
    else:
        for flag in ("scaling_factor", "shift_factor"):
            if getattr(args, flag) is not None:
                ap.error(f"--{flag.replace('_', '-')} is used with --vae only")
        if (args.embedding_key or args.embedding_keyword) and not args.embedding:
            ap.error("--embedding-key and --embedding-keyword go with --embedding")
        if args.pooled_embedding_key and not args.pooled_embedding:
            ap.error("--pooled-embedding-key goes with --pooled-embedding")
        if args.class_keyword and (args.embedding or args.no_condition):
            ap.error("--class-keyword goes with class labels, not with --embedding or --no-condition")

    def fail(message: str) -> int:
        # One line, never a traceback: the export is where a user's own network fails first.
        print(f"{ap.prog}: error: {message}", file=sys.stderr)
        return 1

    try:
        kwargs = json.loads(args.factory_kwargs)
    except ValueError as e:
        ap.error(f"--factory-kwargs is not JSON: {e}")
    if not isinstance(kwargs, dict):
        ap.error("--factory-kwargs must be a JSON object")
    try:
        module = _load_factory(args.factory)(**kwargs)
    except SystemExit:
        raise
    except Exception as e:
        return fail(f"--factory {args.factory} failed: {type(e).__name__}: {e}")
    if args.list_layers:
        marks = layer_marks(module)
        for name, m in module.named_modules():
            if name:
                mark = f"\t({marks[name]})" if name in marks else ""
                print(f"{name}\t{type(m).__name__}{mark}")
        return 0
    if args.vae:
        if not (args.shape and args.out):
            ap.error("--shape and --out are required (or use --list-layers)")
    elif not (args.feature_layer and args.shape and args.out):
        hint = ""
        if not args.feature_layer:
            best = suggest_feature_layer(module)
            hint = f" (suggested feature layer: {best})" if best else ""
        ap.error(f"--feature-layer, --shape and --out are required (or use --list-layers){hint}")
    if args.weights:
        try:
            module.load_state_dict(load_weights(args.weights, args.weights_key, args.strip_prefix))
        except SystemExit:
            raise
        except Exception as e:
            return fail(f"--weights {args.weights}: {type(e).__name__}: {e}")
    if args.vae:
        try:
            export_vae(module, args.out, tuple(args.shape), scaling_factor=args.scaling_factor,
                       shift_factor=args.shift_factor)
        except (ExportError, ValueError, TypeError, OSError) as e:
            return fail(str(e))
        print(f"wrote {args.out}")
        return 0
    extra = []
    if args.pooled_embedding:
        try:
            extra.append(Embedding.from_file(args.pooled_embedding, args.pooled_embedding_key,
                                             "pooled_projections", pooled=True))
        except (OSError, ValueError) as e:
            ap.error(f"--pooled-embedding: {e}")
    if args.embedding:
        try:
            condition: Any = Embedding.from_file(args.embedding, args.embedding_key,
                                                 args.embedding_keyword or "encoder_hidden_states")
        except (OSError, ValueError) as e:
            ap.error(f"--embedding: {e}")
    elif args.class_label is not None:
        condition = args.class_label
    elif args.null_class:
        condition = "null"
    elif args.no_condition:
        condition = None
    else:
        condition = "auto"

    def given(value, default):
        return default if value is None else value

    # Trained weights: the high-noise consistency check means something (consistency_warning).
    trained = bool(args.weights) or args.factory.endswith("from_pretrained")
    try:
        export(module, args.feature_layer, args.out, parameterization=given(args.parameterization, "edm"),
               example_shape=tuple(args.shape), sigma_data=given(args.sigma_data, 0.5),
               schedule=given(args.schedule, "linear"), beta_min=args.beta_min, beta_max=args.beta_max,
               T=given(args.T, 1000), timestep=given(args.timestep, "nearest"), t_scale=args.t_scale,
               condition=condition, class_keyword=given(args.class_keyword, "class_labels"),
               extra_conditions=extra, scheduler=args.scheduler, warn_inconsistent=trained,
               device=(compile_options or {}).get("device", "cpu"), compile=compile_options)
    except (ExportError, ValueError, TypeError, OSError) as e:
        return fail(str(e))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
