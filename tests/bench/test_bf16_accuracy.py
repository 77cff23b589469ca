"""bench/micro/bf16_accuracy.py: a small real run on the default model gives
one row per variant, float32's KL near zero, and records the run."""

from __future__ import annotations

from bench.micro import bf16_accuracy


def test_a_recorded_run_has_a_row_per_variant_and_float32_matches_the_reference(default_model_dir, recorded):
    out = bf16_accuracy.main(["--prompts", "2", "--steps", "2", "--variants", "hf_bf16", "ours_f32"])
    assert set(out) == {"hf_bf16", "ours_f32"}
    assert out["ours_f32"]["mean_kl"] < 1e-6 and out["ours_f32"]["top1_agreement"] == 1.0
    assert 0 < out["hf_bf16"]["mean_kl"] < 0.1
    record = recorded.check("bench.micro.bf16_accuracy")
    [table] = [b for b in record.body if b.kind.value == "table"]
    assert [r[0] for r in table.rows] == [bf16_accuracy.Variant.HF_BF16.value, bf16_accuracy.Variant.OURS_F32.value]
    assert [r["variant"] for r in record.data] == ["hf_bf16", "ours_f32"]
