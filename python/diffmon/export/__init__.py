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

    {"note_version": 1, "kind": "network", "non_persistent_buffers": [...],
     "device_independent": true, "torch": "2.13.0", "input_shape": [1, 16, 16],
     "feature_layer": "mid_block", "parameterization": "eps", "learned_sigma": false,
     "condition": null, "family": "vp", "path": null, "prediction": "eps", "schedule": "linear"}

``family`` (``edm``, ``vp``, ``flow``), ``path`` (a flow path of :data:`FLOW_PATHS`, else null)
and ``prediction`` come from :data:`PARAMETERIZATION_TABLE`; ``schedule`` is a VP network's
(``alphas_cumprod`` for an explicit table), ``t_scale`` a flow or continuous-VP network's time
scale. ``diffmon check-config`` prints them, and for a flow path ``icr.sigma`` in its time.

The note is a versioned contract with the daemon (``diffmon.export.note``): diffmon reads it typed
(``src/engine/model/note.rs``) and refuses a note of a newer ``note_version`` or, in a versioned
note, a field it does not know, at ``check-config`` and at load, naming the file. A note without
``note_version`` (an exporter before version 1) is read with the fields it has.

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
methods. Its note: ``{"note_version": 1, "kind": "vae", "scaling_factor": 0.18215, "shift_factor": 0.0, "encode":
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

The package, one job per module: ``parameterization`` (the table and each conversion to
``D(x; sigma)``), ``condition`` (the condition held fixed), ``trace`` (:func:`export`: the feature
layer, the trace, the device rewriting, the file's note), ``scheduler`` (the checks against the
training scheduler and the consistency warning), ``vae`` (:func:`export_vae`), ``cli`` (the
command line) and ``errors``.
"""

from __future__ import annotations

from .cli import build_parser, load_weights, main
from .condition import Embedding, is_class_conditional, load_embedding, null_class
from .errors import ExportError
from .parameterization import (FLOW_PATHS, PARAMETERIZATION_TABLE, PARAMETERIZATIONS, SCHEDULES,
                               Parameterization, edm_sampling_sigmas, flow_time, vp_alphas_cumprod)
from .scheduler import consistency_warning, read_scheduler_config, scheduler_mismatches, scheduler_round_trip
from .trace import device_constants, export, layer_marks, suggest_feature_layer
from .vae import export_vae

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
