"""Checkpoints written by transformers and in mamba-ssm's layout load into MambaLM with the writers' logits."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mambalab import oracle
from mambalab.inference import CheckpointError, from_pretrained, save_pretrained
from mambalab.modules.lm import LMConfig, MambaLM

IDS = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))


def hf_mamba1(tmp_path, **kw):
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, state_size=8, **kw)
    model = transformers.MambaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    return model


def hf_mamba2(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, state_size=8, head_dim=8,
                                    num_heads=8, n_groups=2, expand=2, chunk_size=4)
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("writer", [hf_mamba1, hf_mamba2])
def test_transformers_checkpoint_gives_transformers_logits_and_round_trips(tmp_path, writer):
    from mambalab import oracle

    if oracle.cuda_extension_available():
        pytest.skip("with mamba-ssm's CUDA extension built, transformers' Mamba calls its CUDA kernels, which "
                    "take no CPU tensors (this comparison runs on the CPU)")
    hf = writer(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(IDS).logits
        torch.testing.assert_close(ours(IDS), expected, atol=1e-4, rtol=1e-4)
    save_pretrained(ours, tmp_path / "back", layout="transformers")
    again = type(hf).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(IDS).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_mamba_ssm_layout_has_its_state_dict_names_and_round_trips(tmp_path, layer):
    oracle.load()
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    ssm_cfg = {"layer": layer, "d_state": 8}
    if layer == "Mamba2":
        ssm_cfg.update(headdim=8, ngroups=2, chunk_size=4)
    cfg = MambaConfig(d_model=32, n_layer=2, vocab_size=45, ssm_cfg=ssm_cfg, fused_add_norm=False)
    torch.manual_seed(0)
    # mamba-ssm's model builds on the CPU (its forward needs its GPU kernels): its own state dict and
    # save_pretrained are the fixture.
    theirs = MambaLMHeadModel(cfg)
    theirs.save_pretrained(str(tmp_path / "ssm"))
    ours = from_pretrained(tmp_path / "ssm")
    assert ours.vocab_size_unpadded == 45 and ours.config.vocab_size == 48
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name.removeprefix("backbone.")], tensor)
    save_pretrained(ours, tmp_path / "back", layout="mamba_ssm")
    back = MambaLMHeadModel(MambaConfig(**json.loads((tmp_path / "back" / "config.json").read_text())))
    back.load_state_dict(torch.load(tmp_path / "back" / "pytorch_model.bin", weights_only=True))
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor)


def test_mamba3_model_round_trips_in_mamba_ssm_layout(tmp_path):
    model = MambaLM(LMConfig(vocab_size=40, d_model=32, layer="Mamba3", d_state=8, headdim=8, ngroups=1,
                             chunk_size=4, scan="reference")).eval()
    save_pretrained(model, tmp_path, layout="mamba_ssm")
    back = from_pretrained(tmp_path)
    ids = IDS.clamp(max=39)
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids))


def test_bad_checkpoints_give_errors_naming_the_problem(tmp_path):
    hf_mamba1(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="shape"):
        from_pretrained(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "some_new_field": 1}))
    with pytest.raises(CheckpointError, match="some_new_field"):
        from_pretrained(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="missing keys.*layers.2"):
        from_pretrained(tmp_path / "a")


def test_hub_id_without_network_says_what_to_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="huggingface-cli download state-spaces/mamba-130m"):
        from_pretrained("state-spaces/mamba-130m")
