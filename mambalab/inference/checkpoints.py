"""Checkpoints in the two layouts people have: mamba-ssm's ``MambaLMHeadModel`` and transformers' ``Mamba*ForCausalLM``.

A checkpoint is a folder (or a hub id resolved to one) holding ``config.json`` and the weights:

* mamba-ssm: ``config.json`` with ``d_model, n_layer, vocab_size, ssm_cfg, rms_norm, …`` (its ``MambaConfig``)
  and ``pytorch_model.bin``; names ``backbone.embedding.weight``, ``backbone.layers.{k}.{norm,mixer}.…``,
  ``backbone.norm_f.weight``, ``lm_head.weight``. The embedding has ``vocab_size`` rounded up to a multiple
  of ``pad_vocab_size_multiple``.
* transformers: ``config.json`` with ``model_type`` "mamba" or "mamba2" and ``model.safetensors``; names as
  above except ``backbone.embeddings.weight``.

:class:`mambalab.modules.MambaLM` has the names of both minus ``backbone.``, so loading is a rename plus a
config translation; everything that does not fit (a key, a shape, a config field) is an error that names it.

The model computed is mamba-ssm's. transformers before 5.23 computes Mamba-2's gated norm over all channels
whatever ``n_groups`` says, where mamba-ssm (and transformers from 5.23) normalises each group: for a
checkpoint with ``n_groups`` > 1 those versions give other logits. The published Mamba-2 checkpoints have one
group, where the two agree.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from mambalab.modules.lm import LMConfig, MambaLM

__all__ = ["CheckpointError", "from_pretrained", "resolve", "save_pretrained", "config_from_dict"]

LAYOUTS = ("mamba_ssm", "transformers")


class CheckpointError(ValueError):
    """A checkpoint that mambalab cannot load as it is: the message names the key, shape or field."""


# ------------------------------------------------------------------------------------------ locating
def resolve(path_or_repo_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as it is; otherwise a hub id, downloaded (or found in the cache) by huggingface_hub."""
    path = Path(path_or_repo_id)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"path_or_repo_id: {path} is a file; pass the folder holding config.json")
    repo_id = str(path_or_repo_id)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as err:  # pragma: no cover - a dependency of the package
        raise CheckpointError(f"{repo_id!r} is not a local folder and huggingface_hub is not installed") from err
    patterns = ["config.json", "*.safetensors", "pytorch_model.bin", "*.json"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as online_err:  # no network, unknown repo, …: try the local cache, then explain
        try:
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                          local_files_only=True))
        except Exception:
            raise CheckpointError(
                f"{repo_id!r} is not a local folder and could not be fetched from the Hugging Face hub "
                f"({type(online_err).__name__}: {online_err}). On a machine with a network, download it with "
                f"`huggingface-cli download {repo_id} --local-dir <folder>` (or "
                f"huggingface_hub.snapshot_download({repo_id!r})), copy the folder here and pass its path; "
                f"it needs config.json and pytorch_model.bin or model.safetensors") from online_err


# ------------------------------------------------------------------------------------------ configs
_MAMBA_SSM_KNOWN = {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
                    "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"}
# transformers' config fields that mambalab reads, or that steer only its code paths, initialisation or generation.
_HF_KNOWN = {"transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
               "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
               "problem_type", "pad_token_id", "bos_token_id", "eos_token_id", "initializer_range",
               "rescale_prenorm_residual", "use_cache", "use_mambapy", "use_associative_scan", "_name_or_path",
               "model_type", "output_attentions", "time_step_scale", "time_step_min", "time_step_max",
               "time_step_init_scheme", "time_step_floor", "residual_in_fp32", "intermediate_size",
               "layer_norm_epsilon", "tie_word_embeddings", "hidden_act", "num_heads", "norm_before_gate",
               "rms_norm", "n_layer", "d_model", "fused_add_norm", "pad_vocab_size_multiple", "ssm_cfg",
               "attn_layer_idx", "attn_cfg", "d_intermediate", "tie_embeddings", "vocab_size", "hidden_size",
               "state_size", "num_hidden_layers", "expand", "conv_kernel", "n_groups", "head_dim",
               "use_bias", "use_conv_bias", "time_step_rank", "time_step_limit", "chunk_size"}


def _detect(config: dict) -> str:
    if config.get("model_type") in ("mamba", "mamba2"):
        return "transformers"
    if "d_model" in config and "n_layer" in config:
        return "mamba_ssm"
    raise CheckpointError("config.json is neither mamba-ssm's MambaConfig (d_model, n_layer, …) nor transformers' "
                          f"Mamba/Mamba2 config (model_type 'mamba' or 'mamba2'); its fields: {sorted(config)}")


def _mamba_ssm_config(c: dict) -> tuple[LMConfig, int]:
    unknown = set(c) - _MAMBA_SSM_KNOWN
    if unknown:
        raise CheckpointError(f"config.json: unsupported mamba-ssm config field(s) {sorted(unknown)}")
    if c.get("d_intermediate", 0):
        raise CheckpointError(f"config.json: d_intermediate = {c['d_intermediate']} (an MLP after each mixer) "
                              f"is not supported; only d_intermediate = 0")
    if c.get("attn_layer_idx"):
        raise CheckpointError(f"config.json: attn_layer_idx = {c['attn_layer_idx']} (attention layers) is not "
                              f"supported; only pure Mamba models")
    if not c.get("rms_norm", True):
        raise CheckpointError("config.json: rms_norm = False (LayerNorm blocks) is not supported; only RMSNorm")
    ssm = dict(c.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    multiple = int(c.get("pad_vocab_size_multiple", 8))
    vocab = int(c["vocab_size"])
    padded = vocab + (-vocab) % multiple
    kw = dict(vocab_size=padded, d_model=int(c["d_model"]), n_layer=int(c["n_layer"]), layer=layer,
              tie_embeddings=bool(c.get("tie_embeddings", True)), scan="reference")
    defaults = {"Mamba1": dict(d_state=16, d_conv=4, expand=2),
                "Mamba2": dict(d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256),
                "Mamba3": dict(d_state=128, expand=2, headdim=64, ngroups=1, chunk_size=64)}
    if layer not in defaults:
        raise CheckpointError(f"config.json: ssm_cfg.layer = {layer!r}; expected one of {sorted(defaults)}")
    for name, default in defaults[layer].items():
        kw[name] = int(ssm.pop(name, default))
    return LMConfig(**kw, ssm_cfg=ssm), vocab


def _json_float(value) -> float:
    """A float from config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _transformers_config(c: dict) -> tuple[LMConfig, int]:
    unknown = set(c) - _HF_KNOWN
    if unknown:
        raise CheckpointError(f"config.json: unsupported transformers config field(s) {sorted(unknown)}")
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act = {c['hidden_act']!r}; only 'silu' is supported")
    d, expand = int(c["hidden_size"]), int(c.get("expand", 2))
    kw = dict(vocab_size=int(c["vocab_size"]), d_model=d, n_layer=int(c["num_hidden_layers"]),
              d_state=int(c.get("state_size", 16)), expand=expand, d_conv=int(c.get("conv_kernel", 4)),
              tie_embeddings=bool(c.get("tie_word_embeddings", True)),
              norm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)), scan="reference")
    ssm = dict(bias=bool(c.get("use_bias", False)), conv_bias=bool(c.get("use_conv_bias", True)))
    if c["model_type"] == "mamba":
        rank = c.get("time_step_rank", "auto")
        ssm["dt_rank"] = math.ceil(d / 16) if rank == "auto" else int(rank)
        return LMConfig(layer="Mamba1", **kw, ssm_cfg=ssm), kw["vocab_size"]
    headdim = int(c.get("head_dim", 64))
    if "num_heads" in c and int(c["num_heads"]) * headdim != expand * d:
        raise CheckpointError(f"config.json: num_heads · head_dim = {c['num_heads']} · {headdim} must equal "
                              f"expand · hidden_size = {expand * d}")
    if not c.get("norm_before_gate", False) is False:
        raise CheckpointError("config.json: norm_before_gate = True is not supported (Mamba-2 gates, then norms)")
    limit = c.get("time_step_limit", (0.0, float("inf")))
    ssm["dt_limit"] = tuple(_json_float(v) for v in limit)
    return LMConfig(layer="Mamba2", headdim=headdim, ngroups=int(c.get("n_groups", 1)),
                    chunk_size=int(c.get("chunk_size", 256)), **kw, ssm_cfg=ssm), kw["vocab_size"]


def config_from_dict(config: dict) -> tuple[LMConfig, str]:
    """config.json's dict -> (:class:`LMConfig`, layout), layout "mamba_ssm" or "transformers"."""
    layout = _detect(config)
    cfg, _ = (_mamba_ssm_config if layout == "mamba_ssm" else _transformers_config)(config)
    return cfg, layout


# ------------------------------------------------------------------------------------------ weights
def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    if st.exists():
        from safetensors.torch import load_file
        return load_file(str(st))
    if pt.exists():
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise CheckpointError(f"{folder} holds no model.safetensors or pytorch_model.bin "
                          f"(sharded checkpoints are not supported)")


def _rename_in(state: dict) -> dict:
    """Checkpoint names -> MambaLM names: drop ``backbone.``; transformers' ``embeddings`` is ``embedding``."""
    out = {}
    for key, value in state.items():
        name = key[len("backbone."):] if key.startswith("backbone.") else key
        if name.startswith("embeddings."):
            name = "embedding." + name[len("embeddings."):]
        out[name] = value
    return out


def _load_into(model: MambaLM, state: dict, source: str) -> None:
    expected = model.state_dict()
    tied = model.config.tie_embeddings
    if tied and "lm_head.weight" not in state and "embedding.weight" in state:
        state = {**state, "lm_head.weight": state["embedding.weight"]}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source}: the weights do not fit the model of its config.json: "
                              f"missing keys {missing}, unexpected keys {unexpected}")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: {name} has shape {tuple(state[name].shape)}; the model of its "
                                  f"config.json expects {tuple(tensor.shape)}")
    if tied and not torch.equal(state["lm_head.weight"], state["embedding.weight"]):
        raise CheckpointError(f"{source}: tie_embeddings is set but lm_head.weight differs from the embedding")
    model.load_state_dict(state)


def from_pretrained(path_or_repo_id, device=None, dtype=None, scan: str = "reference",
                    revision: str | None = None) -> MambaLM:
    """A :class:`MambaLM` from a folder or hub id in mamba-ssm's or transformers' layout (detected from config.json).

    ``scan`` picks the Mamba-2 SSD ("reference" PyTorch or "kernel" Triton; Mamba-3: "reference" or the Triton
    backend). ``model.vocab_size_unpadded`` keeps the tokenizer's vocabulary size of a mamba-ssm checkpoint,
    whose embedding is padded."""
    folder = resolve(path_or_repo_id, revision)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    raw = json.loads(config_path.read_text())
    layout = _detect(raw)
    cfg, vocab = (_mamba_ssm_config if layout == "mamba_ssm" else _transformers_config)(raw)
    if scan not in ("reference", "kernel"):
        raise CheckpointError(f"scan must be 'reference' or 'kernel'; got {scan!r}")
    cfg = LMConfig(**{**cfg.to_dict(), "scan": scan})
    model = MambaLM(cfg)
    _load_into(model, _rename_in(_read_weights(folder)), str(folder))
    model.checkpoint_layout = layout
    model.vocab_size_unpadded = vocab
    return model.to(device=device, dtype=dtype).eval()


# ------------------------------------------------------------------------------------------ saving
def _to_mamba_ssm_config(cfg: LMConfig) -> dict:
    ssm = {"layer": cfg.layer, "d_state": cfg.d_state, "expand": cfg.expand}
    if cfg.layer != "Mamba3":
        ssm["d_conv"] = cfg.d_conv
    if cfg.layer != "Mamba1":
        ssm.update(headdim=cfg.headdim, ngroups=cfg.ngroups, chunk_size=cfg.chunk_size)
    ssm.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.ssm_cfg.items()})
    return dict(d_model=cfg.d_model, d_intermediate=0, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size, ssm_cfg=ssm,
                attn_layer_idx=[], attn_cfg={}, rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
                pad_vocab_size_multiple=1, tie_embeddings=cfg.tie_embeddings)


def _to_transformers_config(cfg: LMConfig) -> dict:
    if cfg.layer == "Mamba3":
        raise CheckpointError("layout='transformers': transformers has no Mamba-3 model; use layout='mamba_ssm'")
    extra = dict(cfg.ssm_cfg)
    c = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
             state_size=cfg.d_state, expand=cfg.expand, conv_kernel=cfg.d_conv,
             use_bias=bool(extra.pop("bias", False)), use_conv_bias=bool(extra.pop("conv_bias", True)),
             hidden_act="silu", layer_norm_epsilon=cfg.norm_epsilon, tie_word_embeddings=cfg.tie_embeddings,
             residual_in_fp32=True)
    if cfg.layer == "Mamba1":
        c.update(model_type="mamba", architectures=["MambaForCausalLM"],
                 time_step_rank=int(extra.pop("dt_rank", math.ceil(cfg.d_model / 16))),
                 intermediate_size=cfg.expand * cfg.d_model)
    else:
        limit = extra.pop("dt_limit", (0.0, float("inf")))
        c.update(model_type="mamba2", architectures=["Mamba2ForCausalLM"], head_dim=cfg.headdim,
                 num_heads=cfg.expand * cfg.d_model // cfg.headdim, n_groups=cfg.ngroups, chunk_size=cfg.chunk_size,
                 time_step_limit=[v if math.isfinite(v) else {"__float__": "Infinity" if v > 0 else "-Infinity"}
                                  for v in limit], norm_before_gate=False)
    if extra:
        raise CheckpointError(f"layout='transformers': mixer option(s) {sorted(extra)} have no transformers "
                              f"config field; use layout='mamba_ssm'")
    return c


def save_pretrained(model: MambaLM, folder, layout: str = "transformers") -> Path:
    """Write ``config.json`` and the weights so that the library of ``layout`` reads them back:
    "transformers" (``model.safetensors``, ``Mamba*ForCausalLM.from_pretrained``) or "mamba_ssm"
    (``pytorch_model.bin``, ``MambaLMHeadModel.from_pretrained``). Returns the folder."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    cfg = model.config
    config = _to_transformers_config(cfg) if layout == "transformers" else _to_mamba_ssm_config(cfg)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_embeddings and layout == "transformers":
            continue  # tied: transformers rebuilds it from the embedding
        key = "backbone." + name if not name.startswith("lm_head.") else name
        if layout == "transformers":
            key = key.replace("backbone.embedding.", "backbone.embeddings.")
        state[key] = tensor.detach().to("cpu").contiguous()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if layout == "transformers":
        from safetensors.torch import save_file
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder
