"""The command line, ``diffmon-export`` (``python -m diffmon.export``): the factory, the weights, the
options, and their help."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Optional

import torch

from .condition import Embedding, null_class, _is_safetensors
from .errors import ExportError
from .parameterization import PARAMETERIZATIONS, PARAMETERIZATION_TABLE, SCHEDULES
from .trace import export, layer_marks, suggest_feature_layer
from .vae import export_vae


def _load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"--factory must look like package.module:callable, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj



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
    from .. import compile as compiling
    compiling.add_arguments(ap)
    return ap


def main(argv=None) -> int:
    from .. import compile as compiling

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
