"""The exercise checkers of chapter 07 accept reference solutions worked out by hand (the state's and the KV
cache's shapes multiplied out, a top-p filter written from its definition) and reject wrong answers without
raising; the parameter-matched Transformer the chapter compares with is counted by hand too."""
import mambalab  # noqa: F401  (before triton)
import pytest
import torch

from mambalab.exercises import ch07
from mambalab.inference import memory
from mambalab.modules.lm import LMConfig, MambaLM


@pytest.mark.parametrize("checker", [ch07.mamba2_layer_state_bytes, ch07.kv_cache_bytes, ch07.top_p_filter])
def test_a_blank_answer_reads_not_attempted_and_a_malformed_one_does_not_raise(checker, capsys):
    assert checker(None) is False and checker(...) is False
    assert "not attempted" in capsys.readouterr().out
    assert checker("not an answer") is False
    assert "✗" in capsys.readouterr().out


def test_mamba2_layer_state_bytes():
    # mamba2-2.7b: d_inner 5120, conv channels 5120 + 2·1·128 = 5376 over a window of 4, bf16;
    # 5120 / 64 = 80 heads of a (64, 128) fp32 state
    conv = 5376 * 4 * 2
    ssm = 80 * 64 * 128 * 4
    assert ch07.mamba2_layer_state_bytes(conv + ssm)
    assert not ch07.mamba2_layer_state_bytes(conv + ssm // 2)          # the state in bf16 (mamba-ssm's cache)
    assert ch07.mamba2_layer_state_bytes(conv + ssm // 2, ssm_element_size=2)
    assert not ch07.mamba2_layer_state_bytes(ssm)                      # the conv state forgotten
    assert ch07.mamba2_layer_state_bytes(4 * (conv + ssm), batch=4)
    small = dict(vocab_size=32, d_model=32, n_layer=2, d_state=16, headdim=8, ngroups=4, expand=2, d_conv=4,
                 chunk_size=16)
    assert ch07.mamba2_layer_state_bytes((64 + 2 * 4 * 16) * 4 * 4 + 8 * 8 * 16 * 4, config=small, element_size=4)


def test_kv_cache_bytes(capsys):
    # the default rival: GQA over 8 key/value heads of 64 (kv width 512), 38 layers, bf16
    want = 2 * 38 * 65536 * 8 * 64 * 2                                 # K and V
    assert want == 5_100_273_664
    assert ch07.kv_cache_bytes(want)
    assert not ch07.kv_cache_bytes(want // 2)                          # K alone
    assert "0.5×" in capsys.readouterr().out
    assert not ch07.kv_cache_bytes(2 * 64 * 65536 * 2560 * 2)          # the same-depth multi-head Transformer
    assert ch07.kv_cache_bytes(2 * 64 * 65536 * 2560 * 2, n_layer=64, kv_heads=None, head_dim=None)
    assert ch07.kv_cache_bytes(2 * 64 * 1024 * 2560 * 2, seqlen=1024, n_layer=64, kv_heads=None, head_dim=None)


MAMBA2_2_7B = LMConfig(vocab_size=50288, d_model=2560, n_layer=64, d_state=128, headdim=64, ngroups=1,
                       chunk_size=256)


def test_matched_transformer_depth_by_hand():
    d = 2560
    # a Mamba-2 block: in_proj d × (2·5120 + 2·128 + 80), conv1d 5376 × (4 + 1), dt_bias/A_log/D 3·80, the gated
    # norm 5120, out_proj 5120 × d, the block's RMSNorm d
    mamba = d * (2 * 5120 + 2 * 128 + 80) + 5376 * 5 + 3 * 80 + 5120 + 5120 * d + d
    assert memory.mamba2_layer_params(MAMBA2_2_7B) == mamba
    assert 6.1 < mamba / d ** 2 < 6.2
    assert memory.transformer_layer_params(d) == 12 * d * d
    assert memory.transformer_layer_params(d, kv_heads=8, head_dim=64) == 2 * d * d + 2 * d * 512 + 8 * d * d
    assert memory.matched_transformer_layers(MAMBA2_2_7B) == round(64 * mamba / (12 * d * d)) == 33
    assert memory.matched_transformer_layers(MAMBA2_2_7B, 8, 64) == round(64 * mamba / (10.4 * d * d)) == 38


def test_mamba2_layer_params_counts_the_modules_weights():
    config = LMConfig(vocab_size=40, d_model=32, n_layer=3, d_state=8, headdim=8, ngroups=2, chunk_size=16,
                      scan="reference")
    model = MambaLM(config)
    per_layer = memory.mamba2_layer_params(config)
    assert sum(p.numel() for p in model.layers.parameters()) == 3 * per_layer
    assert sum(p.numel() for p in model.parameters()) == 40 * 32 + 3 * per_layer + 32


def test_kv_cache_formula_and_measurement_for_a_gqa_rival():
    assert memory.kv_cache_bytes(100, 2560, 38, 1, 2, kv_heads=8, head_dim=64) == 2 * 38 * 100 * 512 * 2
    with pytest.raises(ValueError, match="kv_heads and head_dim"):
        memory.kv_cache_bytes(100, 2560, 38, kv_heads=8)
    small = LMConfig(vocab_size=40, d_model=32, n_layer=3, d_state=8, headdim=8, ngroups=2, chunk_size=16,
                     scan="reference")
    rows = memory.measure_cache_bytes(small, [256], kv_layers=2, kv_width=16)
    assert rows[0]["kv_bytes"] == memory.kv_cache_bytes(256, 32, 2, kv_heads=2, head_dim=8) == 2 * 2 * 256 * 16 * 2
    with pytest.raises(ValueError, match="kv_layers"):
        memory.measure_cache_bytes(small, [256], kv_layers=0)


def test_mamba_ssm_state_is_half_the_ssm_bytes_in_bf16():
    fp32 = memory.mamba2_state_bytes(MAMBA2_2_7B, 1, conv_element_size=2)
    bf16 = memory.mamba2_state_bytes(MAMBA2_2_7B, 1, conv_element_size=2, ssm_element_size=2)
    assert fp32["ssm"] == 80 * 64 * 128 * 4 and bf16["ssm"] == 80 * 64 * 128 * 2
    assert fp32["total"] == 64 * (5376 * 4 * 2 + 80 * 64 * 128 * 4)             # 162.6 MiB
    assert bf16["total"] == 64 * (5376 * 4 * 2 + 80 * 64 * 128 * 2)             # 82.6 MiB


def top_p_by_definition(logits, p):
    """Row by row: add tokens in order of decreasing probability until their mass reaches p."""
    out = torch.full_like(logits, float("-inf"))
    for row in range(logits.shape[0]):
        probs = logits[row].softmax(-1)
        mass = 0.0
        for i in probs.argsort(descending=True).tolist():
            out[row, i] = logits[row, i]
            mass += probs[i].item()
            if mass >= p:
                break
    return out


def test_top_p_filter_accepts_the_definition_and_rejects_near_misses(capsys):
    assert ch07.top_p_filter(top_p_by_definition)

    def one_too_few(logits, p):           # drops the token that makes the mass reach p
        sorted_logits, order = logits.sort(descending=True, dim=-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) >= p
        return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))

    assert not ch07.top_p_filter(one_too_few)
    assert not ch07.top_p_filter(lambda logits, p: logits)                      # keeps everything
    assert not ch07.top_p_filter(lambda logits, p: top_p_by_definition(logits, p).clamp(max=0))  # changes values
    assert not ch07.top_p_filter(lambda logits, p: 1 / 0)
    assert "ZeroDivisionError" in capsys.readouterr().out
